"""Many models on shared hosts: Aegaeon's token-level pooling and the request-level baselines.

    costs.py      swap-time estimates (Aegaeon appendix A.2 eq. 4) and the active-model count (Theorem 3.1)
    aegaeon.py    grouped-FCFS prefill placement (Algorithm 1) and decode work lists with time quotas
                  (Algorithm 2, eq. 2-3)
    turns.py      the turn boundaries of one host's decode turns (which model runs, when its turn ends), over
                  aegaeon.py's work lists; driven live by gateway/control/turns.py
    baselines.py  dedicated, request-level swapping (ServerlessLLM-style) and co-resident multiplexing
                  (MuxServe-style)

Everything here is pure: the caller passes its clock and tells the policy what happened; the virtual-time
simulator (simulator/pooled.py) drives these objects, and a gateway driving shared hosts would drive the same.
"""
