"""Write docs/api.md, the API reference, from the code: every name in ``tplayers.__all__`` and in the
``__all__`` of the public subpackages (SECTIONS), each with its signature and the first paragraph of
its docstring.

    python docs/gen_api.py            # rewrite docs/api.md
    python docs/gen_api.py --check    # exit 1 if docs/api.md differs from what the code gives

``tests/test_docs.py`` regenerates the page in memory and fails when docs/api.md is out of date.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import pathlib
import re
import sys
from typing import Any, Dict, List, Optional, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"
if str(ROOT) not in sys.path:  # document this checkout, not whichever tplayers is installed
    sys.path.insert(0, str(ROOT))

# (module, what it is); tplayers.bench and tplayers.cli are left out: they are the `tplayers` command's
# internals, documented as the command (docs/cli.md); their public entry points are in tplayers.__all__.
SECTIONS: List[Tuple[str, str]] = [
    ("tplayers", "the package: layers, blocks, conversion, checkpoints, switches and checks"),
    ("tplayers.testing", "verify TP modules against dense ones, on spawned CPU ranks"),
    ("tplayers.convert", "parallelize an existing model: plans, styles, coverage, the audit, 2-D meshes"),
    ("tplayers.io", "checkpoints that reshard, dense safetensors"),
    ("tplayers.layers", "the nn.Modules and the model-wide switches"),
]

_RST_ROLE = re.compile(r":(?:class|func|mod|meth|attr|data|obj):`~?([^`]+)`")
_RST_LITERAL = re.compile(r"``(.+?)``")


class _Annotation:
    """An annotation kept as the string the code wrote (``from __future__ import annotations``)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _signature(obj: Any) -> Optional[str]:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    def plain(a: Any) -> Any:
        return _Annotation(a) if isinstance(a, str) else a
    params = [p.replace(annotation=plain(p.annotation)) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=plain(sig.return_annotation)))


def _wrapped(name: str, sig: str, width: int = 100) -> str:
    """``name(sig)``, one parameter a line when it does not fit ``width``."""
    one = f"{name}{sig}"
    if len(one) <= width:
        return one
    inner, ret = _split_signature(sig)
    parts = _top_level_commas(inner)
    return name + "(\n" + "".join(f"    {p.strip()},\n" for p in parts) + ")" + ret


def _split_signature(sig: str) -> Tuple[str, str]:
    depth = 0
    for i, ch in enumerate(sig):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0:
            return sig[1:i], sig[i + 1:]
    raise ValueError(f"unbalanced signature {sig!r}")


def _top_level_commas(text: str) -> List[str]:
    parts, depth, start, quote = [], 0, 0, None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


def _markdown(text: str) -> str:
    text = _RST_ROLE.sub(r"`\1`", text)
    return _RST_LITERAL.sub(r"`\1`", text)


def _first_paragraph(doc: Optional[str]) -> str:
    if not doc:
        return ""
    para = inspect.cleandoc(doc).split("\n\n")[0]
    return _markdown(" ".join(line.strip() for line in para.splitlines()))


def _data_comment(package: str, name: str, value: Any) -> Tuple[Optional[str], str]:
    """(the module that assigns ``name``, the ``#`` comment right above the assignment)."""
    pattern = re.compile(rf"^{re.escape(name)}\s*(?::[^=]+)?=", re.M)
    for modname, mod in sorted(sys.modules.items()):
        if not (modname == package or modname.startswith(package + ".")) or mod is None:
            continue
        if getattr(mod, name, None) is not value:
            continue
        try:
            source = inspect.getsource(mod)
        except (OSError, TypeError):
            continue
        m = pattern.search(source)
        if m is None:
            continue
        lines = source[: m.start()].splitlines()
        comment: List[str] = []
        while lines and lines[-1].lstrip().startswith("#"):
            comment.insert(0, re.sub(r"^\s*#:?\s?", "", lines.pop()))
        return modname, _markdown(" ".join(comment))
    return None, ""


def _entry(section: str, name: str, obj: Any) -> str:
    qual = f"{section}.{name}"
    if inspect.ismodule(obj):
        return (f"### `{qual}`\n\nmodule: see [`{obj.__name__}`](#{_anchor(obj.__name__)}). "
                f"{_first_paragraph(obj.__doc__)}\n")
    if inspect.isclass(obj) or callable(obj):
        kind = "class" if inspect.isclass(obj) else "function"
        where = f"`{obj.__module__}`"
        bases = ""
        if inspect.isclass(obj):
            shown = [b for b in obj.__bases__ if b is not object]
            bases = f", subclass of {', '.join(f'`{b.__qualname__}`' for b in shown)}" if shown else ""
        sig = _signature(obj) if not (inspect.isclass(obj) and issubclass(obj, BaseException)) else None
        own = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
        text = _first_paragraph(own)
        head = f"### `{qual}`\n\n"
        if sig is not None and inspect.isclass(obj) and sig.endswith(" -> None"):
            sig = sig[: -len(" -> None")]  # a constructor's
        code = f"```\n{_wrapped(name, sig)}\n```\n\n" if sig is not None else ""
        return head + code + f"{kind} in {where}{bases}. " + (text or "(no docstring)") + "\n"
    modname, comment = _data_comment(section, name, obj)
    where = f" in `{modname}`" if modname else ""
    return f"### `{qual}`\n\n`{type(obj).__name__}`{where}. " + (comment or "(no comment in the code)") + "\n"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading ``` `heading` ```."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def render() -> str:
    import tplayers

    seen: Dict[int, str] = {}  # id(object) -> where it is documented
    out = [
        "# API reference\n",
        "Generated from the code by `python docs/gen_api.py` (do not edit by hand; `tests/test_docs.py` fails "
        "when this page and the code disagree). Every name in the `__all__` of each module below, with its "
        "signature and the first paragraph of its docstring; the rest of each docstring, and the guides, say "
        "more: [README](../README.md), [layers](layers.md), [models](models.md), [checks](checks.md), "
        "[GPU](gpu.md). `tplayers.bench` and `tplayers.cli` are the `tplayers` command's floors, documented "
        "as the command in [cli.md](cli.md).\n",
        f"tplayers {tplayers.__version__}.\n",
    ]
    out.append("| module | |\n| --- | --- |\n" + "".join(
        f"| [`{section}`](#{_anchor(section)}) | {what} |\n" for section, what in SECTIONS))
    for section, what in SECTIONS:
        mod = importlib.import_module(section)
        out.append(f"## `{section}`\n\n{what[0].upper() + what[1:]}.\n")
        again = []
        for name in mod.__all__:
            obj = getattr(mod, name)
            where = seen.get(id(obj)) if not isinstance(obj, (str, int, float, bool)) else None
            if where is not None:
                again.append(f"[`{name}`](#{_anchor(where)})")
                continue
            seen[id(obj)] = f"{section}.{name}"
            out.append(_entry(section, name, obj))
        if again:
            out.append(f"Also in `{section}.__all__`, the same objects as above: {', '.join(again)}.\n")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/api.md is out of date; write nothing")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT} is out of date: run python docs/gen_api.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
