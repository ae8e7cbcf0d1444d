"""llumnix: the paper's full policy. Dispatch and migration by the reported
freeness, which carries high-priority headroom (Algorithm 1); high-priority
requests are dispatched first and run at their priority."""

from libs.common.policies.base import Policy
from libs.common.policies.freeness import llumnix_dispatch_key, llumnix_dispatch_terms, llumnix_freeness

POLICY = Policy("llumnix", "freeness with priority headroom; migration; priorities",
                score=llumnix_dispatch_key, migrates=True, uses_priorities=True,
                migration_freeness=llumnix_freeness,
                dispatch_terms=llumnix_dispatch_terms)
