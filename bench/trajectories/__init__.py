"""Agent trajectories for the replay benchmark (``bench.replay``): the recorder (``record``) and the local tools
the recorded agent called (``tools``)."""
