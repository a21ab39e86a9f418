"""`python -m bench.fidelity`: the fidelity comparison (bench/fidelity/run.py)."""

from bench.fidelity.run import main

raise SystemExit(main())
