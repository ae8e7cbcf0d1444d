"""The inner services are closed to strangers: with a cluster token, the
cluster serves and migrates as usual, and a call without the token (or with
a wrong one) is UNAUTHENTICATED at every internal service and changes
nothing; with TLS certificates, the same over mutual TLS, and a client with
no certificate cannot even connect."""

import asyncio
import datetime
import ipaddress

import grpc
import httpx
import pytest

from ferry.cluster import ClusterSpec, LocalCluster, free_port, grpc_healthy
from libs.pb import common_pb2 as cpb
from libs.pb import instance_pb2 as ipb
from libs.pb import instance_pb2_grpc as ipb_grpc
from libs.pb import meta_store_pb2 as mpb
from libs.pb import meta_store_pb2_grpc as mpb_grpc
from libs.pb import scheduler_pb2 as spb
from libs.pb import scheduler_pb2_grpc as spb_grpc
from libs.common import rpc
from tests.helpers import expected_fake_text, stream_completion

TOKEN = "t0ken-for-this-cluster"


def start(tmp_path_factory, name: str, **spec) -> LocalCluster:
    c = LocalCluster(ClusterSpec(instances=2, engine="fake", port=free_port(), log_dir=str(tmp_path_factory.mktemp(name)),
                                 instance_args=["--token-delay-ms", "10", "--num-blocks", "512"], **spec))
    c.start(timeout_s=60)
    return c


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory):
    c = start(tmp_path_factory, "token", cluster_token=TOKEN)
    yield c
    c.stop()


def stranger_calls(c: LocalCluster):
    """One call of each kind to each internal service, as a stranger makes them."""
    inst = c.instances()[0]
    chunk = ipb.KvChunk(migration_id="m", stage=0, num_blocks=1, offset=0, data=b"\0" * 8)
    return [
        (c.meta_store, lambda ch: mpb_grpc.MetaStoreStub(ch).Register(mpb.RegisterRequest(
            info=cpb.InstanceInfo(instance_id="intruder", address="127.0.0.1:1")), timeout=5)),
        (c.meta_store, lambda ch: mpb_grpc.MetaStoreStub(ch).List(mpb.ListRequest(), timeout=5)),
        (c.meta_store, lambda ch: list(mpb_grpc.MetaStoreStub(ch).Watch(mpb.WatchRequest(), timeout=5))),
        (c.scheduler, lambda ch: spb_grpc.SchedulerStub(ch).Dispatch(spb.DispatchRequest(
            request_id="x", num_prompt_tokens=3), timeout=5)),
        (c.scheduler, lambda ch: spb_grpc.SchedulerStub(ch).SetTerminating(spb.SetTerminatingRequest(
            instance_id=inst.name, terminating=True), timeout=5)),
        (inst.address, lambda ch: list(ipb_grpc.InstanceStub(ch).Generate(ipb.GenerateRequest(
            request_id="intruder", prompt_token_ids=[97, 98], sampling=cpb.SamplingParams(max_tokens=2)), timeout=5))),
        (inst.address, lambda ch: ipb_grpc.InstanceStub(ch).Abort(ipb.AbortRequest(request_id="victim"), timeout=5)),
        (inst.address, lambda ch: ipb_grpc.InstanceStub(ch).MigrateOut(ipb.MigrateOutRequest(
            dest_instance_id="x", dest_address="127.0.0.1:1"), timeout=5)),
        (inst.address, lambda ch: ipb_grpc.InstanceStub(ch).PreAllocate(ipb.PreAllocateRequest(
            migration_id="m", request_id="r", num_blocks=8, stage=0), timeout=5)),
        (inst.address, lambda ch: ipb_grpc.InstanceStub(ch).TransferKv(iter([chunk]), timeout=5)),
        (inst.address, lambda ch: ipb_grpc.InstanceStub(ch).Commit(ipb.CommitRequest(migration_id="m"), timeout=5)),
        (inst.address, lambda ch: ipb_grpc.InstanceStub(ch).SetTerminating(
            ipb.SetInstanceTerminatingRequest(terminating=True), timeout=5)),
        (inst.address, lambda ch: ipb_grpc.InstanceStub(ch).GetStatus(ipb.GetStatusRequest(), timeout=5)),
    ]


@pytest.mark.parametrize("presented", ["", "wrong-token"], ids=["no token", "wrong token"])
async def test_strangers_are_refused_at_every_service_and_change_nothing(token_cluster, presented):
    c = token_cluster
    async with httpx.AsyncClient(base_url=c.url, timeout=60) as http:
        # A request runs while the stranger tries everything (Abort of it included).
        victim = asyncio.create_task(stream_completion(http, {"prompt": "victim", "max_tokens": 60}))
        await asyncio.sleep(0.2)
        stranger = rpc.Credentials(token=presented)
        for address, call in stranger_calls(c):
            with rpc.sync_channel(address, stranger) as ch:
                with pytest.raises(grpc.RpcError) as e:
                    await asyncio.to_thread(call, ch)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (address, e.value)
        text, final = await victim
    assert text == expected_fake_text("victim", 60)
    # Nothing changed: no intruder registered, nobody marked terminating.
    async with rpc.channel(c.meta_store, c.credentials) as ch:
        listed = await mpb_grpc.MetaStoreStub(ch).List(mpb.ListRequest(), timeout=5)
    assert sorted(r.info.instance_id for r in listed.instances) == ["instance-0", "instance-1"]
    assert not any(r.status.terminating for r in listed.instances)
    # Health checks stay open (probes carry no token).
    assert all(grpc_healthy(ch.address) for ch in c.children if ch.kind != "frontend")


async def test_with_the_token_the_cluster_serves_and_migrates(token_cluster):
    c = token_cluster
    prompt = "carried across"
    async with httpx.AsyncClient(base_url=c.url, timeout=60) as http:
        task = asyncio.create_task(stream_completion(http, {"prompt": prompt, "max_tokens": 80}))
        src = dst = None
        for _ in range(200):  # find where it runs
            for inst in c.instances():
                async with rpc.channel(inst.address, c.credentials) as ch:
                    st = await ipb_grpc.InstanceStub(ch).GetStatus(ipb.GetStatusRequest(), timeout=5)
                if st.requests:
                    src, rid = inst, st.requests[0].request_id
            if src:
                break
            await asyncio.sleep(0.01)
        dst = next(i for i in c.instances() if i is not src)
        async with rpc.channel(src.address, c.credentials) as ch:
            reply = await ipb_grpc.InstanceStub(ch).MigrateOut(ipb.MigrateOutRequest(
                request_id=rid, dest_instance_id=dst.name, dest_address=dst.address), timeout=30)
        text, final = await task
    assert reply.committed == 1, reply
    assert reply.results[0].kv_shared  # the KV from the source's shared cache, the protocol over TLS
    assert text == expected_fake_text(prompt, 80) and final["migrations"] == 1


async def test_the_token_is_not_root(token_cluster):
    """A holder of the cluster token cannot send a request (its prompt, KV
    and client stream) to an address of its own, nor take over a live
    instance's id: migration, handoff and drain destinations must be
    registered instances at their registered address."""
    c = token_cluster
    inst, other = c.instances()
    thief = "127.0.0.1:1"
    async with httpx.AsyncClient(base_url=c.url, timeout=60) as http:
        task = asyncio.create_task(stream_completion(http, {"prompt": "mine", "max_tokens": 80}))
        rid = None
        for _ in range(200):
            for i in c.instances():
                async with rpc.channel(i.address, c.credentials) as ch:
                    st = await ipb_grpc.InstanceStub(ch).GetStatus(ipb.GetStatusRequest(), timeout=5)
                if st.requests:
                    inst, rid = i, st.requests[0].request_id
            if rid:
                break
            await asyncio.sleep(0.01)
        other = next(i for i in c.instances() if i is not inst)
        async with rpc.channel(inst.address, c.credentials) as ch:
            stub = ipb_grpc.InstanceStub(ch)
            for dest_id, address in ((other.name, thief), ("nobody", thief), ("nobody", other.address)):
                with pytest.raises(grpc.RpcError) as e:
                    await stub.MigrateOut(ipb.MigrateOutRequest(request_id=rid, dest_instance_id=dest_id,
                                                                dest_address=address), timeout=10)
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value
            with pytest.raises(grpc.RpcError) as e:
                await stub.Generate(ipb.GenerateRequest(
                    request_id="handed-to-a-thief", prompt_token_ids=[97, 98], sampling=cpb.SamplingParams(max_tokens=2),
                    handoff=ipb.Handoff(instance_id=other.name, address=thief)), timeout=10).read()
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        async with rpc.channel(c.meta_store, c.credentials) as ch:
            with pytest.raises(grpc.RpcError) as e:
                await mpb_grpc.MetaStoreStub(ch).Register(mpb.RegisterRequest(
                    info=cpb.InstanceInfo(instance_id=other.name, address=thief)), timeout=5)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            listed = await mpb_grpc.MetaStoreStub(ch).List(mpb.ListRequest(info_only=True), timeout=5)
        assert {r.info.instance_id: r.info.address for r in listed.instances} == {
            i.name: i.address for i in c.instances()}
        text, final = await task
    assert text == expected_fake_text("mine", 80) and final["migrations"] == 0


def _certificates(folder):
    """A CA, and one certificate for every service of the cluster (127.0.0.1)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    validity = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))

    def build(subject, issuer, key, signer, ca: bool, san=None):
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(validity[0]).not_valid_after(validity[1])
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(signer, hashes.SHA256())

    def pem_key(k):
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ferry test CA")])
    ca = build(ca_name, ca_name, ca_key, ca_key, ca=True)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = build(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ferry")]), ca_name, key, ca_key, ca=False,
                 san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    paths = {n: folder / f"{n}.pem" for n in ("ca", "cert", "key")}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(pem_key(key))
    return {n: str(p) for n, p in paths.items()}


async def test_mutual_tls_with_a_token(tmp_path_factory):
    pem = _certificates(tmp_path_factory.mktemp("pki"))
    c = start(tmp_path_factory, "mtls", cluster_token=TOKEN, tls_cert=pem["cert"], tls_key=pem["key"],
              tls_ca=pem["ca"])
    try:
        async with httpx.AsyncClient(base_url=c.url, timeout=60) as http:
            text, _ = await stream_completion(http, {"prompt": "over tls", "max_tokens": 20})
        assert text == expected_fake_text("over tls", 20)
        inst = c.instances()[0]
        async with rpc.channel(inst.address, c.credentials) as ch:
            st = await ipb_grpc.InstanceStub(ch).GetStatus(ipb.GetStatusRequest(), timeout=5)
        assert st.instance_id == inst.name
        # The compose health check's probe, with the service's own TLS settings from its environment
        # (a plain-text probe fails on a TLS server).
        from libs.common import probe

        env = {"FERRY_TLS_CERT": pem["cert"], "FERRY_TLS_KEY": pem["key"], "FERRY_TLS_CA": pem["ca"]}
        assert probe.serving(inst.address, credentials=probe.credentials_from_env(env))
        assert not probe.serving(inst.address, credentials=probe.credentials_from_env({}), timeout_s=1)
        no_cert = rpc.Credentials(token=TOKEN, tls_ca=pem["ca"])  # trusts the server, has no client cert
        for creds in (no_cert, rpc.Credentials(token=TOKEN)):  # ... and plaintext
            async with rpc.channel(inst.address, creds) as ch:
                with pytest.raises(grpc.RpcError) as e:
                    await ipb_grpc.InstanceStub(ch).GetStatus(ipb.GetStatusRequest(), timeout=3)
            assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        c.stop()
