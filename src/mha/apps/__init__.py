"""Applications built on the mha library: what `python -m mha` runs, and the experiments of the
notebooks. Imports point one way: these modules use the library (mha.functional, layer,
reference, analysis, viz, headview, models, corpus, train); nothing in the library imports them.

- ``tour``: ``python -m mha tour``, the figures of every experiment in one folder
- ``bench``: ``python -m mha bench``, speed and memory against torch and NumPy
- ``timing``: the timing policy of the benchmarks, the tour and the notebooks (turns, medians)
- ``encode_speed``, ``epoch_speed``: a model's forward and a training epoch against torch
- ``corpus``: ``python -m mha corpus``, head statistics over a text file to NetCDF
- ``stats``: ``python -m mha stats``, per-row head statistics along one long text to NetCDF
- ``training``, ``training_figures``: the training experiments on the period-3 task (one vs
  many heads, the sweep over head counts, the head-pruning procedure) and their figures
"""
