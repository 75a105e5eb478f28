"""The help of ``velox-generate`` and ``velox-serve``: one screen, and two more levels.

``--help`` shows the common flags in groups, each with a one-line help (its *brief*), and two
example commands; ``--help-method METHOD`` lists one method's own settings, generated from the
policy registry (:mod:`velox_mlx_lm.flags`); ``--help-all`` shows every flag with its whole
help (mlx-lm's server flags included). Every flag is accepted whether its help is shown or not.
A usage error prints the command's one-line usage and the message.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

from velox_cache_core import Setting, flag_name, policy_for_method
from velox_mlx_lm.flags import ALIASES, setting_argument

HIDDEN = "velox_hidden"  # an action with this attribute set is shown by --help-all only
BRIEF = "velox_brief"  # an action's one-line help on the first screen (else its help)
HELP_POSITION = 26


class BriefHelp(argparse.RawDescriptionHelpFormatter):
    """The first screen: the flags not hidden, each by its brief help."""

    show_all = False

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=HELP_POSITION)

    def add_arguments(self, actions: Iterable[argparse.Action]) -> None:
        shown = [a for a in actions if self.show_all or not getattr(a, HIDDEN, False)]
        super().add_arguments(shown)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        brief = None if self.show_all else getattr(action, BRIEF, None)
        return brief if brief is not None else super()._get_help_string(action)


class AllHelp(BriefHelp):
    """``--help-all``: every flag, with its whole help."""

    show_all = True


class _HelpAll(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> NoReturn:
        parser.formatter_class = AllHelp
        parser.print_help()
        parser.exit()


class _HelpMethod(argparse.Action):
    def __call__(
        self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None
    ) -> NoReturn:
        parser._print_message(method_help(str(values), parser.prog), sys.stdout)
        parser.exit()


def method_help(method: str, prog: str) -> str:
    """``--help-method METHOD``: what the method keeps and its flags, from the registry."""
    from velox_mlx_lm.config import FULL

    usage = f"%(prog)s --method {method}"
    parser = argparse.ArgumentParser(
        prog=prog, add_help=False, formatter_class=BriefHelp, usage=usage
    )
    if method == FULL:
        parser.description = textwrap.fill(
            "full keeps every token: mlx-lm's own cache (KVCache; QuantizedKVCache with "
            "--kv-bits, keys quantized per token). It has no settings: --budget and the other "
            "method flags are refused.",
            width=78,
        )
        return parser.format_help()
    policy = policy_for_method(method)
    parser.usage = f"{usage} [--budget N] [{flag_name(policy.name, 'SETTING')} VALUE ...]"
    others = [m for m in policy.methods if m != method]
    also = f" Policy {policy.name} also serves --method {', '.join(others)}." if others else ""
    summary = policy.summary.get(method, "(a registered policy)")
    parser.description = textwrap.fill(f"{method} {summary}.{also}", width=78)
    shared = [name for name in ALIASES if name in policy.setting_names]
    if shared:
        group = parser.add_argument_group("its settings' short flags (shared by the methods)")
        for name in shared:
            group.add_argument(
                f"--{name.replace('_', '-')}",
                metavar=_metavar(next(s for s in policy.settings if s.name == name)),
                help=f"the same as {flag_name(policy.name, name)}",
            )
    group = parser.add_argument_group(f"{policy.name} settings")
    for setting in policy.settings:
        group.add_argument(flag_name(policy.name, setting.name), **setting_argument(setting))
    return parser.format_help()


def _metavar(setting: Setting) -> str:
    """A setting's value placeholder: its choices, else ``N``, ``X``, ``BOOL`` or ``VALUE``."""
    if setting.choices is not None:
        return "{" + ",".join(map(str, setting.choices)) + "}"
    return {int: "N", float: "X", bool: "BOOL"}.get(setting.kind, "VALUE")


def add_help_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """``-h``, ``--help-method METHOD`` and ``--help-all``, in a group of their own."""
    from velox_mlx_lm.config import methods

    group = parser.add_argument_group("help")
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            _move(parser, action, group)
            action.help = "this screen: the common flags"
    group.add_argument(
        "--help-method",
        action=_HelpMethod,
        choices=methods(),
        metavar="METHOD",
        default=argparse.SUPPRESS,
        help="what METHOD keeps and its own flags (--tova-budget, --h2o-recent, ...)",
    )
    group.add_argument("--help-all", action=_HelpAll, help="every flag, with its whole help")
    return group


def _move(parser: argparse.ArgumentParser, action: argparse.Action, group: Any) -> None:
    """Show ``action`` in ``group``'s section of the help (parsing is unchanged)."""
    for other in parser._action_groups:
        if action in other._group_actions:
            other._group_actions.remove(action)
    group._group_actions.append(action)


def arrange(
    parser: argparse.ArgumentParser,
    usage: str,
    groups: Sequence[tuple[str, Sequence[str]]],
    briefs: Mapping[str, str],
    epilog: str,
) -> None:
    """Lay out ``parser``'s help: the flags ``groups`` names, in that order under those titles
    with the ``briefs`` (flag -> one line) on the first screen, then the help flags; every other
    flag (``--help-all`` shows them, with the method settings) stays accepted."""
    by_flag = {flag: a for a in parser._actions for flag in a.option_strings}
    shown: list[argparse._ArgumentGroup] = []
    for title, flags in groups:
        group = parser.add_argument_group(title)
        for flag in flags:
            _move(parser, by_flag[flag], group)
        shown.append(group)
    for flag, text in briefs.items():
        setattr(by_flag[flag], BRIEF, text)
    help_group = add_help_flags(parser)
    visible = {id(a) for g in (*shown, help_group) for a in g._group_actions}
    for action in parser._actions:
        setattr(action, HIDDEN, id(action) not in visible)
    parser._optionals.title = "other flags"
    rest = [g for g in parser._action_groups if g not in (*shown, help_group)]
    parser._action_groups[:] = [*shown, *rest, help_group]
    parser.usage = usage
    parser.epilog = epilog
    parser.formatter_class = BriefHelp
    name_type_errors(parser)


def name_type_errors(parser: argparse.ArgumentParser) -> None:
    """A value its flag's converter refuses is reported with the converter's message, after
    the flag (argparse's own says ``invalid <function> value``)."""
    for action in parser._actions:
        convert = action.type
        if callable(convert) and convert not in (int, float, str) and not _wrapped(convert):
            action.type = _naming(convert, action.option_strings)


def _wrapped(convert: Any) -> bool:
    return bool(getattr(convert, "velox_named", False))


def _naming(convert: Any, flags: Sequence[str]) -> Any:
    def named(text: str) -> Any:
        try:
            return convert(text)
        except argparse.ArgumentTypeError:
            raise
        except (TypeError, ValueError) as exc:
            message = str(exc)
            for flag in flags:
                message = message.removeprefix(f"{flag} ")
            if repr(text) not in message:
                message = f"invalid value {text!r}: {message}"
            raise argparse.ArgumentTypeError(message) from None

    named.velox_named = True  # type: ignore[attr-defined]
    named.__name__ = getattr(convert, "__name__", "value")
    return named
