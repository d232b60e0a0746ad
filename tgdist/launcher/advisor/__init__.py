"""The strategy advisor (``tgdist plan --profile``): predict every layout's epoch time and memory from
a short profile of the data on this machine and a description of the cluster, rank them, and print
the best as a launch line.

- ``cluster``: the cluster description (machines, trainers, links, memory), presets and YAML;
- ``profile``: what a profile holds (a JSON file) and ``measure``, which takes one;
- ``model``: the prediction, a pure function of a profile and a cluster (``predict``);
- ``report``: the ranked table, the PNG of stage times, launch and sbatch lines, the sweep;
- ``cli``: the command line.
"""
