"""``TorchState``: models, optimizers and samplers, each saved, restored and synced by its
handler; every other attribute as a plain object."""

from __future__ import annotations

import copy

import torch

from ...common.basics import rank
from ...common.elastic import ObjectState
from ..functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .sampler import ElasticSampler


class StateHandler:
    """How one kind of object is saved (a copy of its ``state_dict``), restored and synced."""

    def __init__(self, value):
        self.value = value
        self.saved = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        raise NotImplementedError()

    def set_value(self, value) -> None:
        self.value = value
        self.save()


class ModelStateHandler(StateHandler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(StateHandler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(StateHandler):
    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


_handler_registry = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list:
    return _handler_registry


def set_handler_registry(registry: list) -> None:
    global _handler_registry
    _handler_registry = registry


def _handler(value) -> StateHandler | None:
    for kind, handler in _handler_registry:
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """The state of a PyTorch training: ``model``, ``optimizer`` and any other keyword
    argument (several models or optimizers too), each an attribute. Modules, optimizers and
    :class:`ElasticSampler`s are handled through their ``state_dict``; other values are
    plain objects, broadcast from rank 0 by ``sync``."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for name, value in kwargs.items():
            handler = _handler(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        self._handlers = handlers
        for name, handler in handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def saved_state(self):
        return {**super().saved_state(),
                "handlers": {name: h.saved for name, h in self._handlers.items()}}

    def load_saved_state(self, saved) -> None:
        super().load_saved_state(saved)
        for name, value in saved["handlers"].items():
            self._handlers[name].saved = value

    def __setattr__(self, name, value):
        if name in getattr(self, "_handlers", {}) and hasattr(self, name):
            self._handlers[name].set_value(value)
        super().__setattr__(name, value)
