"""The chaos suite (`make test-chaos`): real processes on loopback broken on purpose.

Each scenario starts its own gateway(s), simulated workers (`fleetgate sim --workers 1`, one process each)
and, where it needs one, its own `redis-server` on a free port, then kills, freezes or floods them and
checks the numbers the hardening issue sets. The fixtures of tests/conftest.py are shared here.
"""

from tests.conftest import *  # noqa: F403  (sim_fleet, sim_fleet_process, gateway_process, make_client, redis_url, ...)
