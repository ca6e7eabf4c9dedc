"""What a run needs around verl, touching none of it: its folder's checkpoint records (:mod:`.checkpoints`), the
check that every node sees the run's files (:mod:`.cluster`), the watchdog that ends a run's leftover processes
(:mod:`.watchdog`), the run's summary (:mod:`.summary`), its folder's record of its config (:mod:`.record`) and
the export of its checkpoints (:mod:`.export`)."""
