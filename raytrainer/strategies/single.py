"""One process, one device: the base behaviour, nothing to synchronise."""

from raytrainer.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    name = "single"
