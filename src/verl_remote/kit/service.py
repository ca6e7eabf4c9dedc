"""A backend's service as a Ray actor that the backend starts, every process re-attaches to, and destroy stops.

The common shape of a self-hosted backend: ``from_config`` on the driver starts the service (a model, its
optimizer, a sampler) as one named Ray actor; the forwarders and rollout servers, each in its own Ray
process, find it by name; ``destroy`` kills it. :class:`RayService` is that, once::

    class MyBackend(RemoteBackend):
        def __init__(self, service: RayService) -> None:
            self.service, self.engine = service, service.actor()

        @classmethod
        def from_config(cls, main_config, *, handle=None):
            if handle is not None:
                return cls(RayService.from_handle(handle))
            settings = main_config.remote_backend
            return cls(RayService.start(MyEngine, str(main_config.actor_rollout_ref.model.path), **resources(settings)))

        def reconnect_handle(self):
            return self.service.handle()

        async def update_weights(self):
            await self.service.call_async("update_weights")   # the engine's own exception, not Ray's wrapper

        async def destroy(self):
            self.service.stop()

Where it runs: ``from_config`` runs in verl's TaskRunner, where Ray is already initialised; the actor is
named in the TaskRunner's namespace (the run's own), so two runs on one cluster never share one. It is not
detached: it ends with the run's driver however the driver ends. Its logical CPUs and GPUs come from the
backend's group file (:func:`resources`); they count against the run's ``ray_kwargs.ray_init.num_cpus``.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass, field
from typing import Any

from verl_remote.kit.errors import ServiceStartError, root_cause

__all__ = ["RayService", "ServiceStartError", "resources"]

#: How long :meth:`RayService.start` waits for the service's constructor.
START_TIMEOUT_S = 600.0


def resources(settings: Any) -> dict[str, float]:
    """``num_cpus`` / ``num_gpus`` from a backend's settings (its group file), defaults 1 and 0."""
    get = settings.get if hasattr(settings, "get") else lambda key, default: getattr(settings, key, default)
    return {"num_cpus": float(get("num_cpus", 1) or 0), "num_gpus": float(get("num_gpus", 0) or 0)}


@dataclass(frozen=True)
class RayService:
    """A named Ray actor: started once by the backend on the driver, found by name everywhere else.

    Keep the object for as long as the service must live: it holds the actor's handle, and Ray ends an actor
    that is not detached once no handle to it is left, whatever its name.
    """

    name: str
    namespace: str
    _handle: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def start(
        cls,
        service_class: type,
        *args: Any,
        prefix: str | None = None,
        num_cpus: float = 1,
        num_gpus: float = 0,
        options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> RayService:
        """Start ``service_class(*args, **kwargs)`` as a named actor and wait until it is constructed.

        A constructor that raises fails here, on the caller's side, with :class:`ServiceStartError` ending in
        the constructor's exception. ``options`` go to
        Ray's ``.options()`` as they are (``max_concurrency``, ``runtime_env``, ...).
        """
        import ray

        what = service_class.__name__
        gpus = float(ray.cluster_resources().get("GPU", 0))
        if num_gpus > gpus:  # Ray would wait for a GPU that no node of this cluster has
            raise ServiceStartError(
                f"the backend's service {what} asks for {num_gpus:g} GPU and the Ray cluster has {gpus:g}: run it "
                "where Ray sees a GPU, or set the backend's device to cpu"
            )
        name = f"{prefix or service_class.__name__.lower()}_{uuid.uuid4().hex[:8]}"
        namespace = ray.get_runtime_context().namespace
        actor = (
            ray.remote(service_class)
            .options(name=name, namespace=namespace, num_cpus=num_cpus, num_gpus=num_gpus, **(options or {}))
            .remote(*args, **kwargs)
        )
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor)
            raise ServiceStartError(
                f"the backend's service {what} did not start within {START_TIMEOUT_S:g} s (Ray could not place it "
                f"with num_cpus={num_cpus:g}, num_gpus={num_gpus:g}{', ' + str(options) if options else ''}, or its "
                "constructor did not return): see `ray status` for what the cluster has"
            ) from None
        except ray.exceptions.RayActorError as exc:
            if not getattr(exc, "_actor_init_failed", False):
                raise
            # Ray keeps the constructor's traceback as text: its last line is the exception itself.
            lines = [line.strip() for line in str(getattr(exc, "error_msg", exc)).splitlines() if line.strip()]
            raise ServiceStartError(
                f"the backend's service {service_class.__name__} failed to start: {lines[-1] if lines else exc}"
            ) from None
        return cls(name, namespace, actor)

    @classmethod
    def from_handle(cls, handle: dict[str, Any]) -> RayService:
        """The service named in ``handle`` (what :meth:`handle` returned on the driver)."""
        return cls(str(handle["actor"]), str(handle["namespace"]))

    def handle(self) -> dict[str, Any]:
        """Plain data for ``reconnect_handle``: the actor's name and namespace."""
        return {"actor": self.name, "namespace": self.namespace}

    def actor(self) -> Any:
        """The actor handle; raises ``ValueError`` naming the service when it is gone."""
        import ray

        if self._handle is not None:
            return self._handle
        try:
            handle = ray.get_actor(self.name, namespace=self.namespace)
        except ValueError:
            raise ValueError(
                f"the backend's service {self.name!r} (Ray namespace {self.namespace!r}) is gone: "
                "it was destroyed, or its run ended"
            ) from None
        object.__setattr__(self, "_handle", handle)
        return handle

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` on the service, waited for. What the service raised is raised here as it
        is (a ``ValueError`` of the engine stays a ``ValueError``), not inside Ray's ``RayTaskError``; a service
        that died raises Ray's ``RayActorError``."""
        import ray

        try:
            return ray.get(getattr(self.actor(), method).remote(*args, **kwargs))
        except ray.exceptions.RayTaskError as exc:
            raise root_cause(exc) from None

    async def call_async(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """:meth:`call` for a coroutine (a rollout server's, a lifecycle method's): awaits instead of blocking."""
        import ray

        try:
            return await getattr(self.actor(), method).remote(*args, **kwargs)
        except ray.exceptions.RayTaskError as exc:
            raise root_cause(exc) from None

    def stop(self) -> None:
        """Kill the actor; nothing happens when it is gone already (``destroy`` must be idempotent)."""
        import ray

        with contextlib.suppress(ValueError):
            ray.kill(self._handle or ray.get_actor(self.name, namespace=self.namespace), no_restart=True)
        object.__setattr__(self, "_handle", None)
