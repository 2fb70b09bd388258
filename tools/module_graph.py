#!/usr/bin/env python3
"""Prints a crate's module import graph and fails on a cycle.

Usage: tools/module_graph.py CRATE_SRC_DIR [--order a,b,c]

Reads every `.rs` file under CRATE_SRC_DIR (tests modules excluded),
attributes it to its top-level module (`src/plan/kernel.rs` -> `plan`,
`src/lib.rs`/`src/main.rs` -> the crate root, skipped), and collects the
`crate::X` paths it uses (in `use` lines and inline paths; comments and
doc links do not count). Prints one line
per module with the modules it imports, then either "no cycles" or each
cycle found, exiting 1 on a cycle. With --order (leaves first), it also
fails when a module imports one listed after it (an upward arrow).
"""
import re
import sys
from pathlib import Path


def module_of(src: Path, f: Path):
    rel = f.relative_to(src)
    if rel.parts[0] in ("lib.rs", "main.rs", "bin"):
        return None
    return rel.parts[0].removesuffix(".rs")


def strip_tests(text: str) -> str:
    # Drop `#[cfg(test)] mod tests { ... }` blocks (brace matched).
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        depth, j = 1, m.end()
        while depth and j < len(text):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    return "".join(out)


def imports(text: str):
    # Comments (and doc links in them) are not imports.
    text = re.sub(r"//[^\n]*", "", text)
    found = set(re.findall(r"\bcrate::(\w+)", text))
    # `use crate::{a, b::c}` groups
    for group in re.findall(r"\bcrate::\{([^}]*)\}", text):
        found |= {p.strip().split("::")[0] for p in group.split(",") if p.strip()}
    # `super::X` from a top-level module's own file means the crate root's X.
    return found


def main():
    args = sys.argv[1:]
    if not args:
        print(__doc__)
        sys.exit(2)
    src = Path(args[0])
    order = []
    if "--order" in args:
        order = args[args.index("--order") + 1].split(",")
    graph = {}
    for f in sorted(src.rglob("*.rs")):
        mod = module_of(src, f)
        if mod is None:
            continue
        deps = imports(strip_tests(f.read_text()))
        graph.setdefault(mod, set()).update(d for d in deps if d != mod)
    for mod in sorted(graph):
        print(f"{mod:12} -> {', '.join(sorted(graph[mod])) or '(leaf)'}")
    # cycles: DFS
    cycles, state, stack = [], {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d in graph and not state.get(d):
                visit(d)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if not state.get(n):
            visit(n)
    bad = False
    for c in cycles:
        print("cycle: " + " -> ".join(c))
        bad = True
    if order:
        rank = {m: i for i, m in enumerate(order)}
        for mod, deps in sorted(graph.items()):
            if mod not in rank:
                print(f"module {mod} is missing from --order")
                bad = True
                continue
            for d in sorted(deps):
                if d in rank and rank[d] > rank[mod]:
                    print(f"upward import: {mod} -> {d}")
                    bad = True
    if not bad:
        print("no cycles" + (", no upward imports" if order else ""))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
