"""The simulated cluster's migration settings: the live MigrationConfig
(from the instances' flags), the delays of the control plane and the KV
link of the cluster's profile. The protocol itself is the live code on the
virtual clock: MigrationManager, SourceMigration, Destination, and Splitwise's
Handoffs and LayerwiseHandoff (ferry/sim/aio.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ferry.sim.params import Delays, TransferModel
from services.instance.migration.messages import MigrationConfig


@dataclass
class MigrationModel:
    config: MigrationConfig
    delays: Delays
    transfer: TransferModel
