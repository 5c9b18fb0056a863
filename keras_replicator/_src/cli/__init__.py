"""The `keras-replicator` command line (`main.py`) and its demo (`demo.py`).

On top of the package: it uses replicators and the launcher (`cluster/`,
which sits below the replicators and imports none of them).
"""
