"""Shell words: how a value from the spec becomes exactly one argument of a command, in the
facts' own commands, the Python command builders and the templates (plan/render.py gives these
to jinja as the `q` and `operands` filters).

The one rule (operations/, plan/ and the other facts/ modules never call shlex themselves;
tests/unit/test_shell_helper.py holds the line): an operand of a command that takes options goes
through `operands`, with the command's own end of options (`--` for getopt and Getopt::Long
programs, git's `--end-of-options`), or `end=""` where the program has none (a shell script
reading "$2", a '-*' case arm): then a leading '-' is refused here and the spec's rule refuses it
at load. Every other word (an assignment, a message, a `sh -c` script, an option's value, a path
pvegpu makes itself) goes through `word`."""

from __future__ import annotations

import shlex


def word(value: object) -> str:
    """One shell word that is `value` literally (shlex.quote of its str); None is refused."""
    if value is None:
        raise ValueError("the q filter got no value (None); a shell word needs one")
    return shlex.quote(str(value))


# How a command that takes options is told that what follows are operands: POSIX utility
# syntax guideline 10 ('--'), which cp, mkdir, rm and git clone follow; git's parse-options
# (parse-options.c) and revision walk (revision.c setup_revisions) take '--end-of-options'
# (git cat-file, git show, where '--' would mean "paths follow"). git checkout (2.39,
# builtin/checkout.c parse_branchname_arg) reads '--end-of-options' as a ref: there `end=""`,
# the value goes before a '--' and one starting with '-' is refused here (and at load).
END_OF_OPTIONS = ("--", "--end-of-options", "")


def operands(values: object, end: str = "--") -> str:
    """The `operands` filter: `end` then each value as one literal shell word (`word`), so a
    value starting with '-' is never read as an option: ``cp {{ [src, dst] | operands }}`` →
    ``cp -- '/srv/x' '/tmp/y'``. `values`: one value or a list of them."""
    if end not in END_OF_OPTIONS:
        raise ValueError(f"the operands filter ends options with one of {END_OF_OPTIONS}, not {end!r}")
    items = list(values) if isinstance(values, (list, tuple)) else [values]
    if not items:
        raise ValueError("the operands filter got no values")
    if not end and any(str(v).startswith("-") for v in items):
        raise ValueError(f"an operand starting with '-' where the command has no end of options: {items!r}")
    return " ".join([*([end] if end else []), *(word(v) for v in items)])


def leading_words(text: str) -> list[str]:
    """The values of the shell words `text` starts with, up to its first unquoted `;` (the
    inverse of joining `word`s): how facts.shared reads back the set a reading was taken over."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";")
    lexer.whitespace_split = True
    words = []
    for token in lexer:
        if token == ";":
            break
        words.append(token)
    return words
