"""The benchmark harness behind ``aiordma bench`` (``cli``): aiordma side by side with
its alternatives, measured in the same run. Plotting (``plot``) needs the ``plot``
extra; the ``pyverbs`` baselines need pyverbs and an RDMA device."""
