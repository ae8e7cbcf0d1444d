"""llumnix_base: Llumnix dispatch and migration (load balancing and
de-fragmentation) without priorities or headroom."""

from libs.common.policies.base import Policy
from libs.common.policies.freeness import base_dispatch_key, base_dispatch_terms, base_freeness

POLICY = Policy("llumnix_base", "freeness dispatch and migration, no priorities",
                score=base_dispatch_key, migrates=True, migration_freeness=base_freeness,
                dispatch_terms=base_dispatch_terms)
