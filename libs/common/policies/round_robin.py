"""round_robin: every instance in turn, blind to load; no migration."""

from libs.common.policies.base import Policy

POLICY = Policy("round_robin", "every instance in turn; no migration", score=None)
