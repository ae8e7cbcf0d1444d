"""The discrete-event cluster simulator (``ferry sim``): Ferry's own policies,
load math, autoscaler decisions and engine core on a virtual clock, in one
process, with the control plane's delays and migration costs as model
parameters (ferry/sim/params.py)."""
