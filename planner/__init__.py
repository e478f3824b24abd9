"""`pdserve plan`: weights, KV bytes, capacity and roofline of a model on a deployment."""
