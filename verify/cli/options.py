"""What every attnstep command shares: the user-error class and the options several commands take.

Defined here once so that every command of verify/cli/ uses the same flags, types and defaults.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import math
import os
import signal
import threading
from pathlib import Path
from typing import Dict, Iterator, Mapping, Optional

import click

from ..check.sizing import NO_MEMORY_EXIT
from ..files.case import output_file_target, probe_writable
from ..files.guards import same_file
from ..files.generate import DEFAULT_DIMS, MAX_SEED
from ..files.kinds import CaseError
from ..files.outputs import parse_name_map, read_names_file
from ..runs.runner import DEFAULT_BUILD_DIR, DEFAULT_RUN_TIMEOUT_S, RunnerError
from ..stages import DEFAULT_INPUT_DIR, DEFAULT_OUTPUT_DIR, DROPOUT_MASK, MAX_HEAD_DIM
from ..variant import ALIGNMENTS, TOP_LEFT, WINDOW_KEYS, dropout_problem, softcap_problem, window_bound_problem

BACKENDS = ("auto", "cuda", "cpu")


class InputError(click.ClickException):
    """A user error: one line on stderr, exit status 2 (or the binary's own status)."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


# What a command was doing, for the line that says it ran out of memory doing it.
_ACTIVITIES = {"check": "checking the stages", "generate": "generating the case", "demo": "running the demo"}


class Interrupted(BaseException):
    """A signal that stops a command (SIGTERM, SIGHUP), raised where the command is, as Ctrl-C raises
    KeyboardInterrupt: the command's own cleanup runs (a generate removes what it began), and it
    ends in one line, as the binary does."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    def __str__(self) -> str:  # (the words a run's unfinished marker records)
        return f"interrupted by signal {self.signum} ({signal.Signals(self.signum).name})"


STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """Within: STOPPING_SIGNALS raise Interrupted (only the main thread can take signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Interrupted(signum)
    before = {sig: signal.signal(sig, stop) for sig in STOPPING_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _interrupted(signum: int) -> InputError:
    """The one line a command stopped by a signal ends with (the binary's words), and 128 + the signal."""
    return InputError(str(Interrupted(signum)), 128 + signum)


def user_errors(fn):
    """Turns CaseError / RunnerError into a one-line message and the right exit status, an OSError
    on a file (one the command's own checks did not name first) into its path and the system's
    reason (exit 2), and a MemoryError (an allocation refused: a low ulimit -v, a container's
    limit) into one line and the binary's exit status for not enough memory, never a traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with _signals_raise():
                return fn(*args, **kwargs)
        except KeyboardInterrupt:
            raise _interrupted(signal.SIGINT) from None
        except Interrupted as exc:
            raise _interrupted(exc.signum) from None
        except CaseError as exc:
            raise InputError(str(exc), getattr(exc, "exit_code", 2)) from None
        except RunnerError as exc:
            if exc.detail:
                click.echo(exc.detail, err=True)
            raise InputError(str(exc), exc.exit_code) from None
        except OSError as exc:
            # A file the command reads or writes that the system refuses (a name too long, no
            # permission, no space): the path and the system's reason, never a traceback.
            if exc.filename is None:
                raise
            raise InputError(f"{exc.filename}: {exc.strerror or exc}", 2) from None
        except MemoryError:
            doing = _ACTIVITIES.get(fn.__name__, f"running {fn.__name__}")
            raise InputError(f"out of memory while {doing}; HINT: fewer heads or smaller matrices (check: "
                             "--max-memory-mb MB plans for the memory there is)", NO_MEMORY_EXIT) from None
        except RuntimeError as exc:
            if type(exc).__name__ != "OutOfMemoryError":  # PyTorch's, on the GPU (check --device)
                raise
            doing = _ACTIVITIES.get(fn.__name__, f"running {fn.__name__}")
            raise InputError(f"out of GPU memory while {doing}; HINT: --device cpu, or free the GPU",
                             NO_MEMORY_EXIT) from None
    return wrapper


def checked_path(check_fn):
    """An option callback that refuses, while the command line is read (before any work), a path
    that check_fn (raising CaseError) rejects: one line naming the option, exit status 2."""
    def callback(ctx, param, value):
        if value is not None:
            try:
                check_fn(value)
            except CaseError as exc:
                opt = param.opts[0]
                raise InputError(str(exc) if str(exc).startswith(opt) else f"{opt} {exc}") from None
        return value
    return callback


def output_files_apart(files: Mapping[str, Optional[Path]]) -> None:
    """Refuses, before the work that fills them, output files ({option: path}) that could not be
    written at its end (their folder missing or read-only, a folder or a device there), or two
    options naming one file, which would keep only the last written: InputError naming the option."""
    given = [(opt, Path(p)) for opt, p in files.items() if p is not None]
    for k, (opt, path) in enumerate(given):
        try:
            report_file(path)
        except CaseError as exc:
            raise InputError(f"{opt} {exc}") from None
        other = next((o for o, p in given[k + 1:] if same_file(path, p)), None)
        if other is not None:
            raise InputError(f"{opt} {path}: is also the {other} file; HINT: give each its own file")


def report_file(path: Path) -> Path:
    """A report's file: a regular file (or a link to one) or nothing yet, in a folder the
    report can be written into, found out before the check runs rather than after."""
    target = output_file_target(path)
    probe_writable(target.parent, path)
    return target


class SharedOption:
    """A click option defined once: `@opt` as defined here, or `@opt.but(help=..., ...)` for a
    command that words it for itself or needs another default."""

    def __init__(self, *decls, **attrs):
        self.decls, self.attrs = decls, attrs

    def __call__(self, fn):
        return click.option(*self.decls, **self.attrs)(fn)

    def but(self, **attrs):
        return click.option(*self.decls, **{**self.attrs, **attrs})


def given_text(ctx, param, value):
    """An option callback: a text option given as "" (an unset shell variable) is refused in one
    line, not taken for the option left out (every stage, no packing, no sanitizer)."""
    if value is not None and not value.strip():
        raise click.BadParameter(f"empty; give its value or leave {param.opts[0]} out", ctx, param)
    return value


class GivenPath(click.Path):
    """click.Path that refuses an empty path: "" (an unset shell variable) would otherwise be the
    working directory, which a command would read or write in place of the folder meant."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value:
            self.fail("an empty path (name a file or folder)", param, ctx)
        try:
            os.lstat(value)
        except OSError as exc:  # (a name too long, a loop of links: the path cannot name anything)
            if exc.errno in (errno.ENAMETOOLONG, errno.ELOOP):
                self.fail(f"{value}: {exc.strerror}", param, ctx)
        return super().convert(value, param, ctx)


class Seconds(click.FloatRange):
    """A time limit in seconds, from 1 on: NaN and inf are refused (no timer takes them, and NaN
    passes every range's comparison)."""

    def convert(self, value, param, ctx):
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value} is not a finite number of seconds", param, ctx)
        return seconds


in_option = SharedOption("--in", "in_dir", type=GivenPath(file_okay=False, path_type=Path),
                         default=DEFAULT_INPUT_DIR, show_default=True, help="Input case folder (Q/K/V).")
out_option = SharedOption("--out", "out_dir", type=GivenPath(file_okay=False, path_type=Path),
                          default=DEFAULT_OUTPUT_DIR, show_default=True,
                          help="Output case folder (the binary's stage files).")
build_option = SharedOption("--build-dir", type=GivenPath(file_okay=False, path_type=Path),
                            default=DEFAULT_BUILD_DIR, show_default=True,
                            help="CMake build folder; built incrementally when needed.")
backend_option = SharedOption("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
                              help="Binary backend; auto uses CUDA when a GPU is present.")
binary_option = SharedOption("--binary", type=GivenPath(exists=True, dir_okay=False, resolve_path=True,
                                                       path_type=Path),
                             help="Run this binary instead of building BUILD_DIR/main (e.g. your own, "
                             "writing the output case of docs/contract.md).")
timeout_option = SharedOption("--timeout", type=Seconds(min=1), default=DEFAULT_RUN_TIMEOUT_S,
                              show_default=True, help="Seconds before the binary is stopped.")
seed_option = SharedOption("--seed", type=click.IntRange(0, MAX_SEED), default=0, show_default=True,
                           help="Random seed.")
force_option = SharedOption("--force", is_flag=True,
                            help="Replace an input case there that attnstep did not generate.")
json_option = SharedOption("--json", "json_path", type=GivenPath(path_type=Path),
                           callback=checked_path(report_file),
                           help="Write the full report as JSON to this file.")
quiet_option = click.option("--quiet", "-q", is_flag=True, help="Print only the verdict, its notes and errors.")


def name_options(fn):
    """--name STAGE=PATTERN (repeatable) and --names FILE: how a program names its stage files."""
    fn = click.option("--names", "names_file", type=GivenPath(exists=True, dir_okay=False, path_type=Path),
                      help="A file of STAGE = \"PATTERN\" lines.")(fn)
    return click.option("--name", "names", multiple=True, metavar="STAGE=PATTERN",
                        help="A stage's file names, e.g. output=O_{i}.txt ({i} head, {b} batch, {h} head in "
                             "batch).")(fn)


def dims_options(fn):
    defaults = DEFAULT_DIMS
    for name, flag, help_text in reversed((
            ("batch", "--batch", "Batch size B."), ("heads", "--heads", "Heads per batch element H."),
            ("seq_q", "--seq-q", "Query rows N."), ("seq_k", "--seq-k", "Key/value rows M."),
            ("d_k", "--d-k", f"Query/key width d_k (1..{MAX_HEAD_DIM}; flash needs 16, 32, 64 or 128)."),
            ("d_v", "--d-v", f"Value width d_v (1..{MAX_HEAD_DIM}; flash needs d_v = d_k)."))):
        # (the widths' bound in the option itself, so that a refusal names --d-k, not the manifest's d_k)
        top = MAX_HEAD_DIM if name in ("d_k", "d_v") else None
        fn = click.option(flag, name, type=click.IntRange(min=1, max=top), default=getattr(defaults, name),
                          show_default=True, help=help_text)(fn)
    return fn


def parse_names(items, names_file) -> Dict[str, str]:
    out = read_names_file(names_file) if names_file else {}
    pairs = {}
    for item in items:
        stage, eq, pattern = item.partition("=")
        if not eq:
            raise click.BadParameter(f"{item!r}: expected STAGE=PATTERN, e.g. output=O_{{i}}.txt",
                                     param_hint="--name")
        pairs[stage.strip()] = pattern.strip()
    out.update(parse_name_map(pairs, "--name"))
    return out


# ----------------------------------------------------------------------------------------------
# The variant's options (docs/contract.md): the same flags in generate, check and run.

BARE = ""  # `--causal` without an alignment


class Alignment(click.ParamType):
    """top-left or bottom-right; after --causal also nothing (BARE)."""
    name = "alignment"

    def convert(self, value, param, ctx):
        if value == BARE or value in ALIGNMENTS:
            return value
        self.fail(f"{value!r}: expected {' or '.join(ALIGNMENTS)}", param, ctx)


class Window(click.ParamType):
    """LEFT,RIGHT: the keys a row sees left and right of its diagonal, -1 unbounded (flash-attn's
    window_size)."""
    name = "window"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        parts = str(value).split(",")
        try:
            bounds = tuple(int(p) for p in parts)
        except ValueError:
            bounds = ()
        if len(bounds) != 2:
            self.fail(f"{value!r}: expected LEFT,RIGHT, two whole numbers >= -1 (-1: unbounded), e.g. 128,0",
                      param, ctx)
        for key, bound in zip(WINDOW_KEYS, bounds):  # each side named by its manifest key, as the binary names it
            why = window_bound_problem(bound)
            if why:
                self.fail(f"{value!r}: {key} = {bound}: {why}", param, ctx)
        return bounds


class Probability(click.ParamType):
    """A dropout probability in [0, 1) (verify/variant.py dropout_problem: as a float32 too)."""
    name = "p"

    def convert(self, value, param, ctx):
        try:
            p = float(value)
        except (TypeError, ValueError):
            p = -1.0
        why = dropout_problem(p)
        if why:
            self.fail(f"{value!r}: {why}", param, ctx)
        return p


class Softcap(click.ParamType):
    """A finite cap >= 0 (0: none; verify/variant.py softcap_problem: finite as a float32 too)."""
    name = "cap"

    def convert(self, value, param, ctx):
        try:
            c = float(value)
        except (TypeError, ValueError):
            c = -1.0
        why = softcap_problem(c)
        if why:
            self.fail(f"{value!r}: {why}", param, ctx)
        return c


causal_option = SharedOption("--causal", type=Alignment(), is_flag=False, flag_value=BARE, default=None,
                             metavar="[top-left|bottom-right]",
                             help="Causal masking, aligned top-left (the default: PyTorch's is_causal) or "
                                  "bottom-right (flash-attn's, when seq_q != seq_k).")
no_causal_option = SharedOption("--no-causal", is_flag=True, help="No causal masking.")
align_option = SharedOption("--align", type=click.Choice(ALIGNMENTS),
                            help="Where row i's diagonal is, for the causal mask, the window and ALiBi: key i "
                                 "(top-left) or key i + seq_k - seq_q (bottom-right).")
window_option = SharedOption("--window", type=Window(), metavar="LEFT,RIGHT",
                             help="Sliding window: row i sees keys diag(i)-LEFT .. diag(i)+RIGHT; -1 unbounded "
                                  "(flash-attn's window_size).")
softcap_option = SharedOption("--softcap", type=Softcap(), metavar="C",
                              help="Cap the scaled scores: C*tanh(S/C) (Gemma-2; flash-attn's softcap; 0: none).")
alibi_option = SharedOption("--alibi", is_flag=True, default=None,
                            help="ALiBi: add -slope_h*|diag(i)-j| to the scores (flash-attn's sign).")
dropout_option = SharedOption("--dropout", type=Probability(), metavar="P",
                              help="Dropout probability of the attention weights (the program writes its "
                                   f"keep-mask as the stage {DROPOUT_MASK}).")
dropout_seed_option = SharedOption("--dropout-seed", type=click.IntRange(0, MAX_SEED), metavar="S",
                                   help="Seed of the binary's dropout mask [default: 0].")


def said_variant(causal=None, no_causal=False, align=None, window=None, softcap=None, alibi=None, dropout=None,
                 dropout_seed=None) -> Dict[str, object]:
    """The Variant fields (verify/variant.py) the command line says, from the options above (None:
    not given). A bare --causal is aligned top-left unless --align says otherwise."""
    if causal is not None and no_causal:
        raise CaseError("--causal and --no-causal: choose one")
    if causal and align and causal != align:
        raise CaseError(f"--causal {causal} with --align {align}: choose one alignment")
    fields: Dict[str, object] = {}
    if causal is not None:
        fields.update(causal=True, align=causal or align or TOP_LEFT)
    elif no_causal:
        fields["causal"] = False
    given = dict(align=align, window=window, softcap=softcap, alibi=alibi, dropout=dropout, dropout_seed=dropout_seed)
    fields.update({k: v for k, v in given.items() if v is not None and k not in fields})
    return fields


# How each Variant field is written on the command line (for messages naming where a value came from).
VARIANT_OPTIONS = {"causal": "--causal", "align": "--align", "window": "--window", "softcap": "--softcap",
                   "alibi": "--alibi", "dropout": "--dropout", "dropout_seed": "--dropout-seed"}
