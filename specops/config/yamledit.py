"""Edit a profile's YAML text in place: values change, comments, key order, quoting and indentation stay.

:func:`edit_yaml` takes ``{field path: new value}`` (or :data:`UNSET` to remove a key) and returns the new
text. It loads the text with ruamel.yaml's round-trip mode, edits the tree and dumps it with the
indentation style that reproduces the file (among common ones); lines ruamel cannot reproduce byte for
byte are transplanted from the original (:func:`transplant`), so only the changed lines differ.

**ruamel.yaml private API.** ruamel has no public way to move the comment lines that *follow* a key, but
inserting or deleting keys needs that: ruamel attaches the comment lines between two keys to the key
before them, so deleting that key would drop the next section's comment, and a key inserted after it
would land below that comment. This module therefore reads and writes two internals:

- ``CommentedMap/CommentedSeq.ca.items``: ``{key: [token, token, token, token]}``, where slot 2 (mappings)
  or slot 0 (sequences) holds the comment token after the value: its own end-of-line comment, a newline,
  then the comment lines that follow (see :func:`_post_slot`);
- ``.fa`` (format attribute): ``flow_style()``, ``set_flow_style()``, ``set_block_style()``, to keep a block
  list a block list and write new short lists in flow style (``[ngram, none]``).

Checked against ruamel.yaml 0.19.1 (the version installed in the development environment; pyproject
allows >= 0.18). ``tests/test_tune.py`` (the YAML edit tests, and a k change in every shipped profile with
a two-line diff) fails if a ruamel release changes this layout.
"""

from __future__ import annotations

import difflib
import io
import os
import re
from pathlib import Path
from typing import Any

from specops.errors import SpecopsError


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


#: An edit's value meaning "remove this key" (written as ``null`` where a base file still sets it).
UNSET = _Unset()

#: Where a new key of a profile goes in its mapping: after the last of these that is present (else at the end).
PLACE_AFTER = {
    "method": (),
    "draft": ("method",),
    "num_speculative_tokens": ("draft_file", "draft_revision", "draft", "method"),
    "ngram": ("num_speculative_tokens", "draft_p_min", "num_speculative_tokens_min", "draft", "method"),
    "per_batch_size": ("ngram", "num_speculative_tokens", "draft", "method"),
    "speculative": ("model", "backend", "name"),
    "fallback": ("proxy", "server", "gpus", "speculative"),
    "min": (),
    "max": ("min",),
    "type": ("max", "min"),
}
#: Indentation styles tried (mapping, sequence, offset), the most common first.
INDENT_STYLES = ((2, 2, 0), (2, 4, 2), (4, 4, 2), (4, 4, 0), (2, 3, 1), (4, 6, 4), (3, 3, 0), (4, 4, 4))


# ---------------------------------------------------------------------------------------------------
# the public functions


def edit_yaml(
    text: str,
    edits: dict[tuple, Any],
    *,
    base_data: dict | None = None,
    comment: str | None = None,
    comment_at: tuple | None = None,
    replace: re.Pattern | None = None,
) -> tuple[str, list[str]]:
    """``text`` with ``edits`` applied (path → value or :data:`UNSET`), comments and order kept.

    ``base_data`` is what the file's ``extends`` bases give (merged): a value to unset that a base sets
    is written as ``null`` (an overlay cannot delete a base's key). ``comment`` goes on its own line above
    the key ``comment_at``; lines matching ``replace`` (an earlier such comment) are removed first.
    Returns (new text, notes).
    """
    from ruamel.yaml.comments import CommentedMap

    notes: list[str] = []
    if replace is not None:
        text = replace.sub("", text)
    style, mismatch = _best_style(text)
    y = _yaml(style)
    data = y.load(text)
    if not isinstance(data, CommentedMap):
        raise SpecopsError("the profile is not a YAML mapping")
    for path, value in edits.items():
        _apply(data, path, value, base_data or {})
    if comment and comment_at:
        _put_comment(text, data, comment, comment_at, style[0])
    new = _dump(y, data)
    if mismatch:
        rt = _dump(_yaml(style), _yaml(style).load(text))
        patched = transplant(text, rt, new)
        if patched is None:
            notes.append("ruamel.yaml rewrote the formatting of parts of the file it could not reproduce")
        else:
            new = patched
    return new, notes


def base_data_of(path: str | Path, env: dict | None = None) -> dict:
    """The merged data of the files ``path`` extends (``{}`` when it extends nothing)."""
    from specops.config import yamlsource
    from specops.paths import builtin_env

    env = {**builtin_env(), **(os.environ if env is None else env)}
    p = Path(path)
    doc = yamlsource.parse(yamlsource.read_text(p, str(path)), str(path), env)
    parents = doc.data.get("extends")
    if not parents:
        return {}
    merged = None
    for parent in [parents] if isinstance(parents, str) else parents:
        d = yamlsource.load(p.parent / parent, env)
        merged = d if merged is None else yamlsource.merge(merged, d)
    return merged.data if merged else {}


def unified_diff(old: str, new: str, name: str) -> str:
    """A ``git diff``-style unified diff of two texts of the file ``name``."""
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{name}", f"b/{name}"))


# ---------------------------------------------------------------------------------------------------
# one edit


def _apply(data, path: tuple, value: Any, base_data: dict) -> None:
    """Apply one edit to the loaded tree ``data``."""
    parent = _parent_of(data, path, value, base_data)
    if parent is not None:
        _set_leaf(parent, path, value, base_data)


def _parent_of(data, path: tuple, value: Any, base_data: dict):
    """The mapping that holds ``path[-1]``; None when a section on the way was missing (it is then written
    whole, with the value, by :func:`_add_branch`)."""
    from ruamel.yaml.comments import CommentedMap

    parent = data
    for i, part in enumerate(path[:-1]):
        if not isinstance(parent.get(part), CommentedMap):
            _add_branch(parent, path, i, value, base_data)
            return None
        parent = parent[part]
    return parent


def _add_branch(parent, path: tuple, i: int, value: Any, base_data: dict) -> None:
    """Write the missing section ``path[i]`` of ``parent`` with ``value`` at the end of ``path``."""
    part = path[i]
    if part in parent and parent[part] is not None:
        raise SpecopsError(f"cannot write {'.'.join(map(str, path))}: {part} is not a mapping")
    if value is UNSET and not _base_sets(base_data, path):
        return  # nothing there to unset
    nested: Any = None if value is UNSET else value  # unset where a base sets it: written as null
    for sub in reversed(path[i + 1 :]):
        nested = {sub: nested}
    if part in parent:  # `part: null`
        parent[part] = _to_node(nested, path[: i + 1])
    else:  # the whole missing branch at once, so comments that follow it land after all of it
        _insert_key(parent, part, nested, path[: i + 1])


def _set_leaf(parent, path: tuple, value: Any, base_data: dict) -> None:
    """Set, replace or remove ``parent[path[-1]]``, keeping the comments around it."""
    key = path[-1]
    if value is UNSET:
        if _base_sets(base_data, path):
            if key in parent:
                parent[key] = None
            else:
                _insert_key(parent, key, None, path)
        elif key in parent:
            _delete_key(parent, key)
    elif key in parent:
        node = _to_node(value, path)
        old = parent[key]
        if hasattr(old, "fa") and hasattr(node, "fa") and not old.fa.flow_style():
            node.fa.set_block_style()  # a list the user wrote as a block stays one
        rest = _detach_following(parent, key) if _is_block(old) else ""
        parent[key] = node
        _attach_following(parent, key, rest)
    else:
        _insert_key(parent, key, value, path)


def _base_sets(base_data: dict, path: tuple) -> bool:
    """Whether the bases give ``path`` a value (not null)."""
    found, value = _get_path(base_data, path)
    return found and value is not None


def _put_comment(text: str, data, comment: str, comment_at: tuple, indent: int) -> None:
    """``comment`` on its own line above the key ``comment_at`` (or its section, if the key was removed)."""
    while len(comment_at) > 1 and not _get_path(data, comment_at)[0]:
        comment_at = comment_at[:-1]
    if _get_path(data, comment_at)[0]:
        parent = data if len(comment_at) == 1 else _get_path(data, comment_at[:-1])[1]
        col = _key_column(text, data, comment_at, indent)
        parent.yaml_set_comment_before_after_key(comment_at[-1], before=comment, indent=col)


def _get_path(data: Any, path: tuple) -> tuple[bool, Any]:
    node = data
    for part in path:
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return False, None
    return True, node


def _key_column(text: str, data, path: tuple, indent: int) -> int:
    """Column of the key at ``path`` (from ruamel's line/column info; nesting × indent for new keys)."""
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    try:
        pos = parent.lc.key(path[-1])
        if pos is not None:
            return pos[1]
    except (KeyError, AttributeError, TypeError):
        pass
    try:
        return parent.lc.col if len(path) > 1 and parent.lc.col is not None else indent * (len(path) - 1)
    except AttributeError:
        return indent * (len(path) - 1)


# ---------------------------------------------------------------------------------------------------
# ruamel.yaml set-up


def _yaml(indent: tuple[int, int, int] = (2, 2, 0)):
    from ruamel.yaml import YAML

    y = YAML()  # round-trip
    y.preserve_quotes = True
    y.width = 4096
    mapping, sequence, offset = indent
    y.indent(mapping=mapping, sequence=sequence, offset=offset)
    # an explicit `null` (ruamel writes an empty value, which reads as a forgotten value in a review)
    y.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    return y


def _dump(y, data) -> str:
    buf = io.StringIO()
    y.dump(data, buf)
    return buf.getvalue()


def _best_style(text: str):
    """The indentation style whose round trip reproduces ``text`` (or comes closest), and its mismatch."""
    best = None
    for style in INDENT_STYLES:
        y = _yaml(style)
        try:
            out = _dump(y, y.load(text))
        except Exception:
            continue
        if out == text:
            return style, 0
        score = sum(
            1
            for op in difflib.SequenceMatcher(None, text.splitlines(), out.splitlines(), autojunk=False).get_opcodes()
            if op[0] != "equal"
        )
        if best is None or score < best[1]:
            best = (style, score)
    return best or ((2, 2, 0), 1)


# ---------------------------------------------------------------------------------------------------
# keys and the comment lines that follow them (ruamel internals: see the module docstring)


def _split_post(token_value: str) -> tuple[str, str]:
    """A post-comment token's text → (the end of its own line, the comment lines after it)."""
    nl = token_value.find("\n")
    if nl < 0:
        return token_value, ""
    return token_value[: nl + 1], token_value[nl + 1 :]


def _is_block(node) -> bool:
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    return isinstance(node, (CommentedMap, CommentedSeq)) and len(node) > 0 and not node.fa.flow_style()


def _post_slot(container, key):
    """(container, key, index) of the post comment of ``container[key]``: for a block collection value, that
    of its deepest last item (where ruamel attaches the comments that follow the whole block)."""
    from ruamel.yaml.comments import CommentedMap

    value = container[key]
    if _is_block(value):
        last = list(value.keys())[-1] if isinstance(value, CommentedMap) else len(value) - 1
        return _post_slot(value, last)
    return container, key, (2 if isinstance(container, CommentedMap) else 0)


def _slot_get(container, key, idx):
    items = container.ca.items.get(key)
    return items[idx] if items and len(items) > idx else None


def _slot_set(container, key, idx, token) -> None:
    items = container.ca.items.setdefault(key, [None, None, None, None])
    while len(items) < 4:
        items.append(None)
    items[idx] = token


def _detach_following(container, key) -> str:
    """Take the comment lines that follow ``container[key]`` (not its own end-of-line comment) off it."""
    slot = _post_slot(container, key)
    tok = _slot_get(*slot)
    if tok is None:
        return ""
    own, rest = _split_post(tok.value)
    if not rest:
        return ""
    if own.strip():
        tok.value = own
    else:
        _slot_set(*slot, None)
    return rest


def _attach_following(container, key, rest: str) -> None:
    """Put comment lines ``rest`` after ``container[key]`` (after its end-of-line comment, if any)."""
    from ruamel.yaml.error import CommentMark
    from ruamel.yaml.tokens import CommentToken

    if not rest:
        return
    slot = _post_slot(container, key)
    tok = _slot_get(*slot)
    if tok is None:
        _slot_set(*slot, CommentToken("\n" + rest, CommentMark(0), None))
    else:
        tok.value = tok.value + rest if tok.value.endswith("\n") else tok.value + "\n" + rest


def _to_node(value: Any, path: tuple):
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    if isinstance(value, dict):
        m = CommentedMap()
        for k, v in value.items():
            m[k] = _to_node(v, path + (k,))
        return m
    if isinstance(value, list):
        s = CommentedSeq(_to_node(v, path + (i,)) for i, v in enumerate(value))
        if all(not isinstance(v, (dict, list)) for v in value):
            s.fa.set_flow_style()  # [ngram, none], [1, 4, 3]
        return s
    return value


def _insert_key(cmap, key, value, path: tuple) -> None:
    keys = list(cmap.keys())
    after = [k for k in PLACE_AFTER.get(key, ()) if k in keys]
    pos = (keys.index(after[0]) + 1) if after else len(keys)
    rest = _detach_following(cmap, keys[pos - 1]) if pos > 0 else ""
    cmap.insert(pos, key, _to_node(value, path))
    _attach_following(cmap, key, rest)


def _delete_key(cmap, key) -> None:
    keys = list(cmap.keys())
    pos = keys.index(key)
    rest = _detach_following(cmap, key)
    if rest and pos == 0:  # nothing before it to carry its comments: keep the key as null instead
        _attach_following(cmap, key, rest)
        cmap[key] = None
        return
    del cmap[key]
    if pos > 0:
        _attach_following(cmap, keys[pos - 1], rest)


# ---------------------------------------------------------------------------------------------------
# formatting ruamel does not reproduce: keep the original's lines


def transplant(original: str, rt_before: str, rt_after: str) -> str | None:
    """Apply the change rt_before → rt_after (both ruamel dumps) to ``original`` line by line.

    For a file whose formatting ruamel does not reproduce exactly: only the lines specops changed (widened
    to the lines around them that ruamel reformatted) are taken from ruamel, every other line stays
    byte-identical. None when a change cannot be placed.
    """
    orig, A, B = original.splitlines(True), rt_before.splitlines(True), rt_after.splitlines(True)
    a_to_o = _line_map(orig, A)
    ops = difflib.SequenceMatcher(None, A, B, autojunk=False).get_opcodes()
    out = list(orig)
    for s, e in reversed(_changed_regions(ops, a_to_o, len(A))):
        o1 = a_to_o[s - 1] + 1 if s > 0 else 0
        o2 = a_to_o[e] if e < len(A) else len(orig)
        if o2 < o1:
            return None
        if s == e:  # a pure insertion: keep whatever lines of the original stand between its neighbours
            o1 = o2
        out[o1:o2] = B[_b_line(ops, s, False, len(B)) : _b_line(ops, e, True, len(B))]
    return "".join(out)


def _line_map(original: list[str], dump: list[str]) -> dict[int, int]:
    """Line of ``dump`` → the identical line of ``original`` (for the lines the two have in common)."""
    out: dict[int, int] = {}
    for blk in difflib.SequenceMatcher(None, original, dump, autojunk=False).get_matching_blocks():
        for k in range(blk.size):
            out[blk.b + k] = blk.a + k
    return out


def _changed_regions(ops, a_to_o: dict[int, int], n_a: int) -> list[list[int]]:
    """[start, end) line ranges of the first dump that changed, widened to lines that match the original."""
    regions: list[list[int]] = []
    for tag, i1, i2, _j1, _j2 in ops:
        if tag == "equal":
            continue
        s, e = i1, i2
        while s > 0 and (s - 1) not in a_to_o:
            s -= 1
        while e < n_a and e not in a_to_o:
            e += 1
        if regions and s <= regions[-1][1]:
            regions[-1][1] = max(regions[-1][1], e)
        else:
            regions.append([s, e])
    return regions


def _b_line(ops, i: int, end: bool, n_b: int) -> int:
    """The line of the second dump at boundary ``i`` of the first (an insertion at ``i`` lies between its
    start and its end)."""
    js = [
        j1 + (i - i1) if tag == "equal" else (j1 if i == i1 else j2)
        for tag, i1, i2, j1, j2 in ops
        if i1 <= i <= i2 and (tag == "equal" or i in (i1, i2))
    ]
    return (max(js) if end else min(js)) if js else n_b
