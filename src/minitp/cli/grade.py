"""``minitp grade FILE``: the final project's scorecard (``minitp.exercises.grade``)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from minitp.exercises.grade import CRITERIA

    gr = sub.add_parser(
        "grade", help="run your final project (student/project.py) on 2-8 processes and print its "
                      "scorecard",
        description="Run your final project (GPT-2 on a dp x pp x tp mesh, by your own code) in "
                    "four layouts, a resharded load and a restart after a planted kill; print one "
                    "line per criterion and exit non-zero if any fails.")
    gr.add_argument("file", metavar="FILE", help="your project, e.g. student/project.py")
    gr.add_argument("--only", metavar="CRITERIA",
                    help=f"a comma-separated subset of: {', '.join(CRITERIA)}")
    gr.set_defaults(func=grade, options=())


def grade(args: argparse.Namespace) -> int:
    from minitp.exercises import grade as grader

    only = None
    if args.only is not None:
        only = tuple(part.strip() for part in args.only.split(",") if part.strip())
    return grader.main(args.file, only)
