"""The Ray Serve application's settings: one frozen config per role and the serving args that
hold them, parsed from the dict (or YAML file) ``build_pdserve_app`` receives.

    PdserveServingArgs.from_dict({"transfer": "grpc", "decode": {"num_replicas": 2}})

Validation follows Ray Serve LLM's PD builder: both worker roles must build the same KV layout
(one compat hash: every KVCompat field their engine flags decide, --model, --block-size,
--dtype, --kv-cache-dtype, ...; kv_layout.py) and a KV transport must be named. Every error
is a ValueError that names the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from services.common.wire import TRANSFERS
from services.ray.kv_layout import KVLayout

ROLES = ("router", "prefill", "decode", "kvstore")


@dataclass(frozen=True)
class RoleConfig:
    """One deployment: a fixed ``num_replicas`` or a Serve ``autoscaling_config`` (not both;
    the router only, since Serve sees no load on the workers: requests reach them over gRPC),
    Ray actor options (``num_cpus`` per replica: CPU-only, no placement groups), and extra
    ``pdserve serve <role>`` flags."""

    num_replicas: int | None = 1
    autoscaling_config: dict[str, Any] | None = None
    ray_actor_options: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 1})
    args: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, role: str, raw: dict[str, Any]) -> RoleConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{role}: unknown keys {unknown}; expected some of {sorted(known)}")
        values = dict(raw)
        if "autoscaling_config" in values and "num_replicas" not in values:
            values["num_replicas"] = None
        config = cls(**{**values, "args": tuple(str(a) for a in values.get("args", ()))})
        if (config.num_replicas is None) == (config.autoscaling_config is None):
            raise ValueError(f"{role}: give exactly one of num_replicas and autoscaling_config")
        if config.num_replicas is not None and config.num_replicas < 1:
            raise ValueError(f"{role}.num_replicas must be >= 1, got {config.num_replicas}")
        return config

    def deployment_options(self) -> dict[str, Any]:
        """Keyword arguments for ``Deployment.options``."""
        options: dict[str, Any] = {"ray_actor_options": dict(self.ray_actor_options)}
        if self.autoscaling_config is not None:
            options["autoscaling_config"] = dict(self.autoscaling_config)
        else:
            options["num_replicas"] = self.num_replicas
        return options

    def flag(self, name: str) -> str | None:
        """The value given for ``name`` (``--flag value`` or ``--flag=value``) in ``args``."""
        for i, word in enumerate(self.args):
            if word == name and i + 1 < len(self.args):
                return self.args[i + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
        return None


@dataclass(frozen=True)
class PdserveServingArgs:
    """The whole application. ``transfer`` has no default: name the KV transport. ``host`` is
    what each service binds; replicas publish it, or their node's IP when it is 0.0.0.0.
    ``kvstore`` None: no kvstore deployment. Seconds for timeouts."""

    transfer: str
    router: RoleConfig = RoleConfig()
    prefill: RoleConfig = RoleConfig()
    decode: RoleConfig = RoleConfig()
    kvstore: RoleConfig | None = RoleConfig(ray_actor_options={"num_cpus": 0.1})
    kvstore_gib: float = 1.0
    model: str | None = None
    redis_url: str = ""
    host: str = "127.0.0.1"
    startup_timeout_s: float = 600.0
    drain_grace_s: float = 10.0
    log_dir: str = ""

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | str | Path) -> PdserveServingArgs:
        """From a dict, or the path of a YAML file holding one."""
        if isinstance(raw, (str, Path)):
            import yaml

            raw = yaml.safe_load(Path(raw).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"serving args must be a mapping, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown keys {unknown}; expected some of {sorted(known)}")
        if raw.get("transfer") not in TRANSFERS:
            raise ValueError(f"transfer must be one of {list(TRANSFERS)} (the KV transport "
                             f"between prefill and decode), got {raw.get('transfer')!r}")
        values: dict[str, Any] = dict(raw)
        for role in ROLES:
            if role in values and values[role] is not None:
                values[role] = RoleConfig.from_dict(role, values[role])
        args = cls(**values)
        args.check()
        return args

    def for_replicas(self) -> PdserveServingArgs:
        """These args without replica counts and actor options: what the replicas are built
        from, so a change of scale alone leaves them (and their version) as they are."""
        def strip(config: RoleConfig) -> RoleConfig:
            return RoleConfig(num_replicas=1, ray_actor_options={}, args=config.args)
        return dataclasses.replace(
            self, router=strip(self.router), prefill=strip(self.prefill), decode=strip(self.decode),
            kvstore=None if self.kvstore is None else strip(self.kvstore))

    def check(self) -> None:
        for role in ("prefill", "decode", "kvstore"):
            config = getattr(self, role)
            if config is not None and config.autoscaling_config is not None:
                raise ValueError(f"{role}.autoscaling_config: Serve cannot autoscale the {role} "
                                 "deployment (requests reach its service over gRPC, so Serve "
                                 "sees no load); give num_replicas (HPA/KEDA scale it on Helm)")
        if self.kvstore_gib <= 0:
            raise ValueError(f"kvstore_gib must be > 0, got {self.kvstore_gib}")
        if self.startup_timeout_s <= 0 or self.drain_grace_s < 0:
            raise ValueError("startup_timeout_s must be > 0 and drain_grace_s >= 0")
        self.kv_layout("prefill").check_matches(self.kv_layout("decode"))

    def kv_layout(self, role: str) -> KVLayout:
        """The KV layout the ``role`` workers' flags (``model``, then the role's ``args``)
        build. ValueError naming the role for a bad engine flag."""
        config: RoleConfig = getattr(self, role)
        try:
            return KVLayout.of_argv([*(["--model", self.model] if self.model else []), *config.args])
        except ValueError as error:
            raise ValueError(f"{role}.args: {error}") from error
