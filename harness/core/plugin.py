"""The one base class of every built-in plugin (Lightning's ``Callback`` is the model).

A plugin says what it is with class attributes instead of three repeated hooks::

    class MyCheck(Plugin):
        \"\"\"my_check: one line that ``harness plugins`` prints.\"\"\"

        name = "my_check"
        Options = MyCheckOptions          # a pydantic model (extra="forbid"), or None
        CODES = (MY_CODE, MY_OTHER_CODE)  # every FindingCode it may report
        requires = ("data_hash",)         # plugins whose files or findings it reads

        def setup(self, ctx):             # once per run, after the options are known
            self.window = []

        @hookimpl
        def on_step_end(self, ctx, step, metrics):
            self.report(MY_CODE.code, "what happened, in numbers", limit=10)

``add_config``, ``declare_codes`` and ``configure`` are implemented here once.
``self.report(..., limit=N)`` is the one rate limit: after N findings of a code
the plugin goes quiet for that code and the Nth says so. A plugin whose
``requires`` are not enabled keeps running; ``self.missing`` names what is
off, and ``self.unchecked(code, what)`` reports that once per run instead of
going silent. Third-party plugins may keep plain ``@hookimpl`` classes: the
manager treats both alike.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from harness.core.findings import Finding, FindingCode
from harness.core.hookspecs import hookimpl

if TYPE_CHECKING:
    from harness.core.protocols import PluginContext


class Plugin:
    """Base of the built-in plugins: options, codes, configuration, rate limits and requirements in one place."""

    name: ClassVar[str] = ""
    Options: ClassVar[type[BaseModel] | None] = None
    CODES: ClassVar[tuple[FindingCode, ...]] = ()
    requires: ClassVar[tuple[str, ...]] = ()

    ctx: "PluginContext"
    options: Any
    missing: tuple[str, ...] = ()

    # -- the three declarations, once for every plugin ------------------------------------

    @hookimpl
    def add_config(self) -> type[BaseModel] | None:
        return self.Options

    @hookimpl
    def declare_codes(self) -> list[FindingCode]:
        return list(self.CODES)

    @hookimpl
    def configure(self, ctx: "PluginContext", options: BaseModel | None) -> None:
        self.ctx = ctx
        self.options = options if options is not None or self.Options is None else self.Options()
        self._report_counts: dict[str, int] = {}
        self._unchecked: set[str] = set()
        enabled = set(getattr(getattr(ctx, "manager", None), "names", ()) or ())
        self.missing = tuple(name for name in self.requires if name not in enabled)
        self.setup(ctx)

    def setup(self, ctx: "PluginContext") -> None:
        """Per-run set-up after ``self.options`` and ``self.ctx`` are set (override; the default does nothing)."""

    def idle_hooks(self, *hooks: str, idle: bool = True) -> None:
        """Have the manager skip (``idle=True``) or call again this plugin's ``hooks``: decided per run, usually in
        ``on_run_start``, so a plugin with nothing to do in this run costs no call per step."""
        manager = getattr(getattr(self, "ctx", None), "manager", None)
        if manager is not None and hasattr(manager, "set_idle"):
            manager.set_idle(getattr(self, "registered_name", self.name), hooks, idle)

    # -- reporting --------------------------------------------------------------------------

    def report(self, code: str, message: str, *, limit: int | None = None, say_limit: bool = True, **kwargs: Any) -> Finding | None:
        """``ctx.report`` with this plugin's name and an optional per-code limit for the run.

        Returns the finding, or None once ``limit`` findings of ``code`` were
        made (the last one allowed says that the rest are held back, unless
        ``say_limit=False``: for a plugin whose limit varies, like nan_guard's
        "ten, then every hundredth").
        """
        counts = self.__dict__.setdefault("_report_counts", {})
        count = counts.get(code, 0) + 1
        counts[code] = count
        if limit is not None and count > limit:
            return None
        if say_limit and limit is not None and limit > 1 and count == limit:
            message = f"{message} (the {limit} {code} findings allowed per run are reached: further ones are not reported)"
        kwargs.setdefault("plugin", self.name or None)
        return self.ctx.report(code, message, **kwargs)

    def reported(self, code: str) -> int:
        """How many findings of ``code`` this plugin tried to report in this run (limited or not)."""
        return self.__dict__.get("_report_counts", {}).get(code, 0)

    def unchecked(self, code: str, what: str, **kwargs: Any) -> Finding | None:
        """Report once per run that ``what`` was not checked because a required plugin is off."""
        done = self.__dict__.setdefault("_unchecked", set())
        if code in done:
            return None
        done.add(code)
        off = ", ".join(self.missing) or "a required plugin"
        return self.report(
            code,
            f"{what} was not checked: plugin {off} is not enabled ({self.name} reads its records). "
            f"Fix: enable {off} (remove it from `disable:` or add it to `plugins:`).",
            evidence={"requires": list(self.requires), "missing": list(self.missing), **kwargs.pop("evidence", {})},
            **kwargs,
        )

    # -- one device read per step -------------------------------------------------------------

    def defer(self, key: str, tensor: Any) -> None:
        """Queue a device tensor to be read at this step's guard, with every other plugin's, in one transfer."""
        self.ctx.defer(key, tensor, owner=self.name)

    def deferred(self, key: str) -> list[Any]:
        """The host values of ``key`` queued before this step's guard (one entry per ``defer`` call, in order)."""
        return self.ctx.deferred(key, owner=self.name)
