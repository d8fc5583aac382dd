"""``looplm kernels build`` / ``looplm kernels status``: looplm's CPU extension, explicitly."""

from __future__ import annotations

import json


def status_line(st) -> str:
    """One line for ``looplm info`` and ``looplm kernels status``."""
    if st.variant == "off":
        return f"off ({st.reason})"
    if st.loaded and not st.reason:
        return f"built and loaded ({st.variant})"
    if st.built and not st.reason:
        return f"built ({st.variant})"
    if st.built:
        return f"built ({st.variant}); {st.reason}"
    return f"{st.variant}: {st.reason}"


def _cmd_status(args) -> int:
    from . import status

    st = status(load=args.load)
    if args.json:
        out = st.to_dict()
        if args.load:
            from .. import dispatch
            from . import load

            load()
            out["dispatch"] = dict(dispatch.describe())
        print(json.dumps(out, indent=2))
        return 0
    print(f"CPU kernels: {status_line(st)}")
    print(f"  build directory  {st.path or '-'}")
    if args.load:
        from .. import dispatch
        from . import load

        load()
        for what, provider in dispatch.describe():
            print(f"  {what:52s} {provider}")
    return 0


def _cmd_build(args) -> int:
    from . import build

    st = build()
    print(f"CPU kernels: {status_line(st)}" + (f" in {st.build_seconds:.1f} s" if st.build_seconds else ""))
    return 0 if st.loaded or st.variant == "off" else 1


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "kernels", help="looplm's CPU extension: build it now, or show whether it is built and why not"
    )
    sub = p.add_subparsers(dest="kernels_command", required=True)
    b = sub.add_parser(
        "build", help="build (once per CPU variant and source version) and load the extension; `make install` runs it"
    )
    b.set_defaults(func=_cmd_build)
    s = sub.add_parser(
        "status", help="built or not, the variant for this CPU, the build directory, the reason when it cannot run"
    )
    s.add_argument(
        "--load",
        action="store_true",
        help="also load it (building it if needed) and list who serves each dispatch point",
    )
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_cmd_status)
