"""The speculative methods specops knows, and how they rank.

A method is an engine-neutral name; each backend maps it to its own spelling (vLLM ``method`` values,
llama-server ``--spec-type`` values). The fallback order comes from what each method needs: a trained
draft (EAGLE-family heads, a draft model, MTP layers) is best when it fits, n-gram needs nothing but the
prompt, and ``none`` always works.
"""

from __future__ import annotations

from enum import Enum


class Method(str, Enum):
    EAGLE = "eagle"
    EAGLE3 = "eagle3"
    MEDUSA = "medusa"
    MLP_SPECULATOR = "mlp_speculator"
    DRAFT_MODEL = "draft_model"
    MTP = "mtp"
    DFLASH = "dflash"
    DSPARK = "dspark"
    NGRAM = "ngram"
    SUFFIX = "suffix"
    NONE = "none"
    AUTO = "auto"

    def __str__(self) -> str:  # so f-strings and click print "eagle3", not "Method.EAGLE3"
        return self.value


#: Methods whose draft is a separate set of weights (a head or a model) that must be found and checked.
NEEDS_DRAFT = frozenset(
    {
        Method.EAGLE,
        Method.EAGLE3,
        Method.MEDUSA,
        Method.MLP_SPECULATOR,
        Method.DRAFT_MODEL,
        Method.DFLASH,
        Method.DSPARK,
    }
)
#: Methods that take no draft weights at all.
DRAFTLESS = frozenset({Method.NGRAM, Method.SUFFIX, Method.NONE, Method.MTP})
#: Model-based methods ("better" than n-gram when they fit): the start of every fallback chain.
MODEL_BASED = NEEDS_DRAFT | {Method.MTP}
#: Prompt-lookup methods: no model, propose tokens copied from the context.
LOOKUP = frozenset({Method.NGRAM, Method.SUFFIX})

#: Published default for the number of draft tokens per step (EAGLE papers and vLLM docs use 3–5).
DEFAULT_K = {
    Method.EAGLE: 4,
    Method.EAGLE3: 4,
    Method.MEDUSA: 4,
    Method.MLP_SPECULATOR: 3,
    Method.DRAFT_MODEL: 4,
    Method.MTP: 1,
    Method.DFLASH: 15,  # github.com/z-lab/dflash README: a block of 16 (15 drafted + 1) per step
    Method.DSPARK: 7,  # vLLM sets it to the drafter's block_size when unset; DSpark drafts are block-7
    Method.NGRAM: 4,
    Method.SUFFIX: 8,
}

#: Rank for fallback: lower is "better" (tried first). Used to order chains and retries.
RANK = {
    Method.EAGLE3: 0,
    Method.EAGLE: 1,
    Method.MTP: 2,
    Method.DFLASH: 3,
    Method.DSPARK: 4,
    Method.MEDUSA: 5,
    Method.MLP_SPECULATOR: 6,
    Method.DRAFT_MODEL: 7,
    Method.SUFFIX: 8,
    Method.NGRAM: 9,
    Method.NONE: 10,
}


def default_chain(method: Method) -> list[Method]:
    """What to fall back to after ``method``: model-based → ngram → none; ngram/suffix → none."""
    if method in MODEL_BASED:
        return [Method.NGRAM, Method.NONE]
    if method in LOOKUP:
        return [Method.NONE]
    return []
