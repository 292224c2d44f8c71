"""User-space WAN emulation: emulated links (rate, delay, jitter, chunk priorities) and the emulator process."""
from geomx.netem.emulator import WanEmulator, profile_from_env, run_from_env
from geomx.netem.link import EmulatedLink, LinkEngine

__all__ = ["EmulatedLink", "LinkEngine", "WanEmulator", "profile_from_env", "run_from_env"]
