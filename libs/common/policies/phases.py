"""Splitwise's two-step dispatch (docs/design.md §8.1): pure code over snapshots, shared
by the scheduler and the simulator.

A new request goes to an instance that prefills (role ``prefill`` or
``mixed``), chosen by the policy's own score among those. When its prompt is
done it decodes on an instance that decodes (``decode`` or ``mixed``), again by
the policy's score; where that is the instance it is on, nothing moves.
Otherwise its KV goes over on the migration protocol, serialized after the
prompt for short prompts and layer by layer while the prompt computes for long
ones (``handoff_mode``).

``place`` makes both choices at dispatch: the live scheduler (and the
frontend's bypass) hand the decode instance to the prefill instance with the
request, so nothing asks the scheduler again when the prompt is done."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

from libs.common.policies.base import Dispatcher, DispatchRequest, InstanceView, affine, demand_blocks
from libs.common.types import Role

# Splitwise (ISCA'24, §4.3): serialized transfer is cheaper below about 512
# prompt tokens; above, per-layer transfer hides the copy behind the prompt's
# later layers. This is the paper's value (the simulator's default). The live
# instance's ``--handoff-per-layer-threshold`` defaults to 0 (serialized):
# ``ferry bench handoff-modes`` found no crossover on a 2-core CPU, where the
# per-layer copies compete with the prompt for the same cores
# (docs/results/handoff_modes.json).
DEFAULT_PER_LAYER_THRESHOLD = 512


class Phase(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class HandoffMode(str, enum.Enum):
    SERIALIZED = "serialized"
    PER_LAYER = "per_layer"


def serves(role: Role, phase: Phase) -> bool:
    return role.prefills if phase is Phase.PREFILL else role.decodes


def phase_views(views: list[InstanceView], phase: Phase) -> list[InstanceView]:
    """The instances that run ``phase``. A cluster with no instance of the
    phase's roles (all prefill, say) keeps every instance: better a request
    served colocated than refused."""
    own = [v for v in views if serves(v.status.role, phase)]
    return own or list(views)


def choose_for_phase(dispatcher: Dispatcher, views: list[InstanceView], req: DispatchRequest,
                     phase: Phase) -> str | None:
    return dispatcher.choose(phase_views(views, phase), req)


def is_split(views: list[InstanceView]) -> bool:
    """Whether any instance is not mixed: only then does dispatch have two steps."""
    return any(v.status.role is not Role.MIXED for v in views)


def needs_handoff(role: Role) -> bool:
    """A request prefilled on an instance of this role must move to decode."""
    return not role.decodes


def handoff_mode(num_prompt_tokens: int, per_layer_threshold: int = DEFAULT_PER_LAYER_THRESHOLD) -> HandoffMode:
    if per_layer_threshold > 0 and num_prompt_tokens >= per_layer_threshold:
        return HandoffMode.PER_LAYER
    return HandoffMode.SERIALIZED


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a request runs: ``prefill`` takes it now; ``decode``, when set,
    receives its KV once the prompt is done (None: it decodes where it
    prefilled)."""

    prefill: str
    decode: str | None = None


def place(dispatcher: Dispatcher, views: list[InstanceView], req: DispatchRequest) -> Placement | None:
    """Both steps of the dispatch at once (None: no instance at all). With
    only mixed instances this is the policy's one-step choice. The decode
    instance is chosen among instances that decode, by the same score, for
    the prompt plus its first token, never the prefill instance itself; where
    none can take it the request decodes where it prefills."""
    near = affine(views, req)
    if near is not None:
        return Placement(near)
    if not is_split(views):
        iid = dispatcher.choose(views, req)
        return None if iid is None else Placement(iid)
    first = choose_for_phase(dispatcher, views, req, Phase.PREFILL)
    if first is None:  # every prefilling instance excluded (the request failed there): anywhere else
        first = dispatcher.choose(views, req)
        if first is None:
            return None
    role = next(v.status.role for v in views if v.instance_id == first)
    if not needs_handoff(role):
        return Placement(first)
    decoders = [v for v in views if serves(v.status.role, Phase.DECODE) and v.instance_id != first]
    # The prefix hits count for the decode step too: a decode instance that
    # holds the prompt's prefix links it and receives only the rest
    # (PreAllocate.link; a per-layer handoff too: the linked blocks' layers are not sent).
    then = dataclasses.replace(req, num_prompt_tokens=req.num_prompt_tokens + 1, exclude=req.exclude | {first})
    if not [v for v in decoders if v.instance_id not in then.exclude]:
        return Placement(first)
    return Placement(first, dispatcher.choose(decoders, then))


def uncounted(instance_id: str, request_id: str, blocks: int) -> None:
    """``count_placed``'s ``add_pending`` where placements are not counted
    (the scheduler's --no-dispatch-pending: dispatch reads the reports alone)."""


def count_placed(placed: Placement, req: DispatchRequest, block_size_of: Callable[[str], int], hashed_at: int,
                 add_pending: Callable[[str, str, int], None]) -> int:
    """What a placement takes until its instances report the request, the one
    count of the scheduler's Dispatch, the frontend's bypass and the
    simulator: the prefill instance the prompt's blocks net of the prefix it
    holds (where the prompt was hashed at that instance's block size:
    ``hashed_at``), the decode instance the prompt and its first token.
    ``add_pending(instance, request, blocks)``: the view's. Returns the
    prompt's blocks the prefill instance holds, as counted."""
    bs = block_size_of(placed.prefill)
    hit = req.hits.get(placed.prefill, 0) if bs == hashed_at else 0
    add_pending(placed.prefill, req.request_id, demand_blocks(req.num_prompt_tokens, bs, hit))
    if placed.decode is not None:
        add_pending(placed.decode, req.request_id, demand_blocks(req.num_prompt_tokens + 1, block_size_of(placed.decode)))
    return hit
