"""The devices a plan runs on: emulated CPU devices, and profiles of heterogeneous ones (speed, memory, links)
measured or declared, from which heterogeneous plans take their shares.

>>> from spmd import devices
>>> devices.Profile.from_speeds([2, 1]).speeds
(2.0, 1.0)
"""

from spmd._devices import backend_started, emulate_devices, free_memory
from spmd._profile import Device, Profile, measure, parse_bytes

__all__ = ["Device", "Profile", "backend_started", "emulate_devices", "free_memory", "measure", "parse_bytes"]
