"""Which actuator an autoscaler runs (`autoscale.actuator.kind`): the one place that knows every kind, so the
kinds' modules (gateway/control/actuators.py, gateway/control/docker_actuator.py) need not import each other."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.control.actuators import Actuator, ActuatorContext, SimActuator, WebhookActuator
from gateway.control.docker_actuator import DockerActuator

if TYPE_CHECKING:
    from gateway.config import AutoscaleConfig


def make_actuator(cfg: AutoscaleConfig, ctx: ActuatorContext) -> Actuator:
    kind = cfg.actuator.kind
    if kind == "sim":
        return SimActuator(ctx, cfg.actuator.sim)
    if kind == "webhook":
        return WebhookActuator(ctx, cfg.actuator.webhook)
    if kind == "docker":
        return DockerActuator(ctx, cfg.actuator.docker)
    return Actuator(ctx)
