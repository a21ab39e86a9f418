"""The simulator's fidelity toolchain: real vLLM (CPU build) against the simulator, and the profile fitted to it.

    python -m bench.fidelity              the comparison; writes bench/results/fidelity.md (run.py)
    python -m bench.fidelity.calibrate    fit simulator/profiles/tiny-cpu.yaml alone (calibrate.py)
    python -m bench.fidelity.step_trace   the real engine's steps beside a profile (vllm_hook/ records them)
    python -m bench.fidelity.at_speed     replay a finished run's levels at the engine's measured speed

`harness.py` holds what they share (the real server, the machine, the streaming client), `legs.py` the
workload, the open-loop legs and their comparison. Running processes of the product (gateway, simulator) comes
from bench/harness.py, as for every benchmark. Needs the vLLM CPU environment of `make test-vllm`.
"""
