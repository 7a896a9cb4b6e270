"""A page's Python process (``run_blocks.Page``): runs the page's ``python`` blocks one after another in one
namespace, as a notebook would, and answers each on the descriptor named by its argument (one JSON line:
``{"ok": true}`` or the traceback).

    python docs/_tools/page_python.py FD     (requests on stdin: {"code": ..., "file": ..., "line": ...} per line)

The blocks run as in ``python -c``: in a ``__main__`` module without a file (``paratrain.launch`` forks the
workers of a function defined there, as in a notebook), with the working directory (the page's folder) first
on ``sys.path``, not this file's folder.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import types


def main() -> None:
    out = os.fdopen(int(sys.argv[1]), "w")
    module = types.ModuleType("__main__")
    sys.modules["__main__"] = module
    sys.argv[:] = ["-c"]
    sys.path[0] = ""
    for line in sys.stdin:
        req = json.loads(line)
        try:
            exec(compile("\n" * (req["line"] - 1) + req["code"], req["file"], "exec"), module.__dict__)
            res = {"ok": True}
        except BaseException:  # noqa: BLE001 - a block's failure, whatever it is, is the page's report
            res = {"ok": False, "error": traceback.format_exc()}
        sys.stdout.flush()
        sys.stderr.flush()
        out.write(json.dumps(res) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
