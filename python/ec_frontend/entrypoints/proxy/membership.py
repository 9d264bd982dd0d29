"""Which instances the proxy routes to: the command line's, those registered at
run time, and only those that answer.

Roles are vLLM's EPD-proxy roles: ``encode``, ``prefill``, ``decode`` and
``prefill_decode`` (an instance that prefills and decodes, the E+PD layout;
given on the command line as ``--decode`` with no ``--prefill``). A deployment
is either E+PD or E+P+D: registering ``prefill_decode`` beside ``prefill`` /
``decode`` instances (or the reverse) is a :class:`MembershipConflict`, as is
changing a registered URL's role without unregistering it first. The command
line may name one URL in several roles (an aggregated instance serving as both
encoder and decoder): the roster is keyed by role and URL, and health is the
URL's, shared by its roles.

With dynamic registration (vLLM's ``--dynamic-registration`` API, served by
``app.py``) a launcher adds instances with ``POST /instances`` (a record
``{"role", "url", "ec_zmq_addrs", "dp_size"}``) and removes them with ``DELETE
/instances?url=...``; ``GET /instances`` is :meth:`Membership.status`.

Health: every ``probe_interval`` seconds each instance's ``GET /health`` is
probed with ``probe_timeout``. A live instance that fails ``fail_threshold``
probes in a row (a request that cannot reach it counts as a failed probe) is
evicted: taken out of rotation and probed with backoff (the interval doubled
per failed probe, at most ``MAX_BACKOFF`` intervals) until it answers, when it
is live again. An instance that has never answered is still starting (a proxy
is often started beside instances that load a model for a minute): it is probed
every interval, without backoff, so it joins the rotation at most one interval
after it comes up. When every instance of a role is out of rotation, requests
go to them anyway, in the policy's order (a last resort: an answer puts the
instance back at once, a refused connection fails fast). A registered instance
evicted for ``evicted_ttl`` seconds is forgotten (0 keeps probing it forever);
instances from the command line are never forgotten. Nothing here is shared
between proxy replicas: replicas given the same instances see the same live set
once their probes agree, and the routing policies (``routing.py``) are functions of that set.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger("ec_frontend.proxy")

DEFAULT_PROBE_INTERVAL = 5.0
DEFAULT_PROBE_TIMEOUT = 2.0
DEFAULT_FAIL_THRESHOLD = 3
DEFAULT_EVICTED_TTL = 900.0
#: The longest wait between probes of an evicted instance, in probe intervals.
MAX_BACKOFF = 8


class Role(str, enum.Enum):
    ENCODE = "encode"
    PREFILL = "prefill"
    DECODE = "decode"
    PREFILL_DECODE = "prefill_decode"


_SPLIT = frozenset({Role.PREFILL, Role.DECODE})


class MembershipConflict(ValueError):
    """A registration that does not fit the deployment (vLLM answers 409)."""


@dataclass(frozen=True)
class MembershipConfig:
    """Flags of the membership (vLLM's EPD-proxy names and defaults)."""

    dynamic_registration: bool = False
    probe_interval: float = DEFAULT_PROBE_INTERVAL
    probe_timeout: float = DEFAULT_PROBE_TIMEOUT
    fail_threshold: int = DEFAULT_FAIL_THRESHOLD
    evicted_ttl: float = DEFAULT_EVICTED_TTL

    def __post_init__(self) -> None:
        if self.probe_interval < 0:
            raise ValueError("--probe-interval must be at least 0 (0 turns probing off)")
        if self.probe_timeout <= 0:
            raise ValueError("--probe-timeout must be positive")
        if self.fail_threshold < 1:
            raise ValueError("--fail-threshold must be at least 1")
        if self.evicted_ttl < 0:
            raise ValueError("--evicted-ttl must be at least 0")


@dataclass
class Instance:
    """One instance and what the proxy knows of its health."""

    role: Role
    url: str
    ec_zmq_addrs: list[str] = field(default_factory=list)
    dp_size: int = 1
    static: bool = False
    failures: int = 0
    answered: bool = False
    evicted_at: float | None = None
    next_probe: float = 0.0

    def record(self) -> tuple[Role, str, tuple[str, ...], int]:
        return self.role, self.url, tuple(self.ec_zmq_addrs), self.dp_size


class Membership:
    """The instances of each role, live or evicted, and the probe loop that moves them."""

    def __init__(
        self,
        config: MembershipConfig,
        *,
        on_eject: Callable[[Instance], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._instances: dict[tuple[Role, str], Instance] = {}
        self._on_eject = on_eject
        #: Called when an evicted instance answers again (the proxy's ``/health``
        #: forgets a cached "down").
        self.on_return: Callable[[Instance], None] | None = None
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    # ---- the roster ---------------------------------------------------------

    def add_static(self, role: Role, urls: Iterable[str]) -> None:
        for url in urls:
            self.register(Instance(role, url, static=True))

    def register(self, instance: Instance) -> bool:
        """Adds ``instance`` (``True``) or refreshes a known one's record, keeping its
        health (``False``)."""
        roles = {i.role for i in self._instances.values() if i.url != instance.url}
        if (instance.role is Role.PREFILL_DECODE and roles & _SPLIT) or (
            instance.role in _SPLIT and Role.PREFILL_DECODE in roles
        ):
            raise MembershipConflict("cannot mix prefill_decode with standalone prefill/decode")
        known = self._instances.get((instance.role, instance.url))
        if known is None and not instance.static and self._of(instance.url):
            raise MembershipConflict("unregister the instance before changing its role")
        if known is not None:
            known.ec_zmq_addrs = list(instance.ec_zmq_addrs)
            known.dp_size = instance.dp_size
            return False
        self._instances[instance.role, instance.url] = instance
        log.info("instance %s (%s) joined", instance.url, instance.role.value)
        return True

    def unregister(self, url: str) -> bool:
        """Drops an instance, in every role, for good (a probe cannot bring it back)."""
        gone = self._of(url)
        for instance in gone:
            del self._instances[instance.role, url]
            log.info("instance %s (%s) unregistered", url, instance.role.value)
        return bool(gone)

    def _of(self, url: str) -> list[Instance]:
        return [i for i in self._instances.values() if i.url == url]

    def live(self, role: Role) -> list[str]:
        """The URLs of ``role`` in rotation, in the order they joined."""
        return [i.url for i in self._instances.values() if i.role is role and i.evicted_at is None]

    def evicted(self, role: Role) -> list[str]:
        """The URLs of ``role`` out of rotation, in the order they joined."""
        mine = self._instances.values()
        return [i.url for i in mine if i.role is role and i.evicted_at is not None]

    def roles(self) -> set[Role]:
        return {i.role for i in self._instances.values()}

    def get(self, url: str) -> Instance | None:
        """The instance at ``url`` (the first role it joined in)."""
        mine = self._of(url)
        return mine[0] if mine else None

    def status(self) -> dict[str, Any]:
        """``{role: {"live": [url], "evicted": [url]}}`` for every role (vLLM's shape)."""
        out: dict[str, Any] = {}
        for role in Role:
            mine = [i for i in self._instances.values() if i.role is role]
            out[role.value] = {
                "live": [i.url for i in mine if i.evicted_at is None],
                "evicted": [i.url for i in mine if i.evicted_at is not None],
            }
        return out

    # ---- health -------------------------------------------------------------

    def report_success(self, url: str) -> None:
        for instance in self._of(url):
            instance.failures = 0
            instance.answered = True
            if instance.evicted_at is not None:
                instance.evicted_at = None
                log.info("instance %s (%s) answers again; back in rotation", url,
                         instance.role.value)  # fmt: skip
                if self.on_return is not None:
                    self.on_return(instance)

    def report(self, url: str, ok: bool) -> None:
        """One probe's result (``/health`` of the proxy probes too)."""
        if ok:
            self.report_success(url)
        else:
            self.report_failure(url)

    def report_failure(self, url: str) -> None:
        """One failed probe or unreachable request; evicts at ``fail_threshold``."""
        now = self._clock()
        for instance in self._of(url):
            self._failed(instance, now)

    def _failed(self, instance: Instance, now: float) -> None:
        url = instance.url
        instance.failures += 1
        if instance.evicted_at is not None:
            backoff = 1
            if instance.answered:
                backoff = min(2 ** (instance.failures - self.config.fail_threshold), MAX_BACKOFF)
            instance.next_probe = now + backoff * self.config.probe_interval
            return
        if instance.failures < self.config.fail_threshold:
            return
        instance.evicted_at = now
        instance.next_probe = now + self.config.probe_interval
        log.warning(
            "instance %s (%s) failed %d times in a row; out of rotation until it answers",
            url,
            instance.role.value,
            instance.failures,
        )
        if self._on_eject is not None:
            self._on_eject(instance)

    def _forget_expired(self, now: float) -> None:
        ttl = self.config.evicted_ttl
        if ttl <= 0:
            return
        for key, instance in list(self._instances.items()):
            if instance.static or instance.evicted_at is None or now - instance.evicted_at < ttl:
                continue
            del self._instances[key]
            log.warning("instance %s (%s) stayed down for %g s; forgotten", instance.url,
                        instance.role.value, ttl)  # fmt: skip

    async def probe_once(self, client: httpx.AsyncClient) -> None:
        """One round: every live instance, and the evicted ones whose backoff is over."""
        now = self._clock()
        due = list(dict.fromkeys(
            i.url for i in self._instances.values() if i.evicted_at is None or i.next_probe <= now
        ))  # fmt: skip
        results = await asyncio.gather(*(self._probe(client, url) for url in due))
        for url, ok in zip(due, results, strict=True):
            self.report(url, ok)
        self._forget_expired(self._clock())

    async def _probe(self, client: httpx.AsyncClient, url: str) -> bool:
        try:
            resp = await client.get(url + "/health", timeout=self.config.probe_timeout)
        except Exception:
            return False
        return resp.status_code == 200

    async def _loop(self, client: httpx.AsyncClient) -> None:
        while True:
            await asyncio.sleep(self.config.probe_interval)
            try:
                await self.probe_once(client)
            except Exception:
                log.exception("a probe round failed")

    def start(self, client: httpx.AsyncClient) -> None:
        """Starts probing (in the running event loop) unless ``probe_interval`` is 0."""
        if self._task is None and self.config.probe_interval > 0:
            self._task = asyncio.get_running_loop().create_task(self._loop(client))

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class BadRecord(ValueError):
    """A registration body that is not a record (its message and the field at fault)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def parse_url(value: Any, param: str = "url") -> str:
    """An instance's base URL, without its trailing slash."""
    if not isinstance(value, str) or not value.startswith(("http://", "https://")):
        raise BadRecord(f"{param} must be an http(s) URL", param)
    url = httpx.URL(value)
    if not url.host:
        raise BadRecord(f"{param} must name a host", param)
    return value.rstrip("/")


def parse_registration(data: Any) -> Instance:
    """The instance a ``POST /instances`` body registers (vLLM's record: ``role``,
    ``url``, optional ``ec_zmq_addrs`` (one per DP replica, EC consumers only) and
    ``dp_size``)."""
    if not isinstance(data, dict):
        raise BadRecord("the body must be a JSON object", "body")
    roles = ", ".join(r.value for r in Role)
    try:
        role = Role(data.get("role"))
    except ValueError:
        raise BadRecord(f"role must be one of {roles}", "role") from None
    url = parse_url(data.get("url"))
    dp_size = data.get("dp_size", 1)
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise BadRecord("dp_size must be an integer of at least 1", "dp_size")
    addrs = data.get("ec_zmq_addrs", [])
    if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
        raise BadRecord("ec_zmq_addrs must be a list of strings", "ec_zmq_addrs")
    if addrs and len(addrs) != dp_size:
        raise BadRecord("ec_zmq_addrs needs one address per DP replica", "ec_zmq_addrs")
    if addrs and role not in (Role.PREFILL, Role.PREFILL_DECODE):
        raise BadRecord("only EC consumers (prefill, prefill_decode) take ec_zmq_addrs",
                        "ec_zmq_addrs")  # fmt: skip
    return Instance(role, url, list(addrs), dp_size)
