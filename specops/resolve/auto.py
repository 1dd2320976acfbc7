"""``method: auto`` and candidate ranking: the published advice for a speedup without training.

1. a published EAGLE-3 / EAGLE head for the target that passes the checks (one with no warnings first);
2. else MTP, when the target has MTP layers;
3. else a same-family small draft model that passes the checks;
4. else n-gram (prompt lookup), which needs nothing.

Medusa and MLP speculators are not picked by ``auto`` (vLLM 0.33 removed both) but are resolved when asked
for by name. Within a method group, candidates rank by how they were tied to the target (catalog >
speculators verifier / Medusa base > card base_model / base_model tag > name), then downloads and likes.
"""

from __future__ import annotations

from specops.methods import RANK, Method

#: Method groups of the auto policy, tried in this order.
AUTO_GROUPS = {Method.EAGLE3: 0, Method.EAGLE: 0, Method.MTP: 1, Method.DRAFT_MODEL: 2, Method.NGRAM: 3}
AUTO_METHODS = tuple(AUTO_GROUPS)
USABLE = ("ok", "warning")


def methods_for(requested: Method, backend_methods) -> list[Method]:
    """Methods to look for: the one asked for, or the auto policy's (those the backend runs)."""
    if requested is Method.AUTO:
        return [m for m in AUTO_METHODS if backend_methods is None or m in backend_methods]
    return [requested]


def sort_key(candidate, requested: Method):
    """Rank: method group (auto policy, or the requested method first), trust of the tie, popularity."""
    if requested is Method.AUTO:
        group = AUTO_GROUPS.get(candidate.method, 9)
    else:
        group = 0 if candidate.method is requested else 1 + RANK.get(candidate.method, 9)
    return (
        group,
        candidate.trust,
        RANK.get(candidate.method, 9),
        -candidate.downloads,
        -candidate.likes,
        (candidate.draft or "").lower(),
    )


def choose(candidates, requested: Method):
    """The best usable candidate among the methods allowed (``requested`` or the policy's): the best method
    group first; within it a candidate that passes cleanly beats one with warnings; then rank order."""
    allowed = set(AUTO_METHODS) if requested is Method.AUTO else {requested}
    usable = [(i, c) for i, c in enumerate(candidates) if c.method in allowed and c.verdict in USABLE]
    if not usable:
        return None
    group = (lambda c: AUTO_GROUPS.get(c.method, 9)) if requested is Method.AUTO else (lambda c: 0)
    return min(usable, key=lambda ic: (group(ic[1]), ic[1].verdict != "ok", ic[0]))[1]
