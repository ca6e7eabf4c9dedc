"""verl-arctic: the Arctic Platform backend for verl-remote (work in progress).

What is here so far: the two body encodings of Arctic's RL HTTP protocol
(:mod:`verl_arctic.wire`). The backend, its worker and replica, the client and
the test server follow; until then this distribution registers no backend, so
installing it changes nothing for ``verl-remote list``. The protocol is
described in docs/arctic-protocol.md.
"""

__version__ = "0.1.0"
