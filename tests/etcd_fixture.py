"""A real etcd for the tests, started like any other component (ferry/etcd_local.py).
Skipped, with the reason, only where the etcd binary is missing."""

from __future__ import annotations

import pytest

from ferry.etcd_local import LocalEtcd, binary

needs_etcd = pytest.mark.skipif(binary() is None, reason="no etcd binary on PATH (apt-get install etcd-server; "
                                                         ".ci/run installs it)")


@pytest.fixture
def etcd_server(tmp_path):
    if binary() is None:
        pytest.skip("no etcd binary on PATH (apt-get install etcd-server)")
    server = LocalEtcd(data_dir=str(tmp_path / "etcd"), log_path=str(tmp_path / "etcd.log"))
    server.start()
    yield server
    server.close()
