"""The seams into verl: the plugin verl imports in every process (:mod:`.verl_plugin`, :mod:`.verl_hooks`), the
trainer and TaskRunner (:mod:`.trainer`), the CPU-only forwarder workers (:mod:`.worker`) and the rollout replica
(:mod:`.rollout`) every backend subclasses, the backend's handle passed between them (:mod:`.handoff`), verl's
rewards as data (:mod:`.rewards`), and the list of verl's names all of these rely on (:mod:`.seams`)."""
