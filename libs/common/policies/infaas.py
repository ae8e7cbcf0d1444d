"""infaas++ (the paper's INFaaS++ baseline): the least memory load, queued
demand included; no migration. The new request's demand is the same
everywhere, so it leaves the ranking as it is."""

from libs.common.policies.base import Policy
from libs.common.policies.freeness import memory_load

POLICY = Policy("infaas++", "least memory load including queued demand; no migration",
                score=lambda v, blocks: (-memory_load(v),))
