"""``fleet plan``: choose the fleet's autoscaling knobs by simulation.

A traffic trace (:mod:`planner.trace`) is replayed through a discrete-event model of the fleet
(:mod:`planner.model`, scaled by the KEDA/HPA rules of :mod:`planner.scaler`) for every setting of a
grid (:mod:`planner.grid`); :mod:`planner.report` writes the table and plots, :mod:`planner.replay`
checks the model against a real fleet on this machine.
"""

__all__: list[str] = []
