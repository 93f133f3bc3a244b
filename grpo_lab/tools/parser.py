"""The command line's parser: a user mistake is one line and exit code 2, never a
traceback or argparse's usage dump. Shared by the CLI and the tools it hands off to."""

from __future__ import annotations

import argparse


class UsageError(Exception):
    """A bad flag or value: the CLI prints `grpo_lab: error: <message>` and exits 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse would print usage too)
        raise UsageError(message)
