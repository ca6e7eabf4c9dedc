"""The backend author's kit, below everything else and free of verl: the lifecycle contract
(:class:`~verl_remote.kit.backend.RemoteBackend`), the backend's entry-point value
(:class:`~verl_remote.kit.spec.BackendSpec`), tensors on the wire (:mod:`.payload`), verl's losses and sampling
computed where the model lives (:mod:`.compute`), a Ray actor as the service (:mod:`.service`) and the errors
everyone raises (:mod:`.errors`).

Authors import these names from the face, ``verl_remote``; the module paths are not part of the stable API.
"""
