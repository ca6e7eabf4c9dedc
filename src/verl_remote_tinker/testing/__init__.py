"""Test and development aids, not the backend: SkyRL's open-source Tinker server run on this machine
(:mod:`.local_server`, started by ``python -m verl_remote_tinker.local_server``)."""
