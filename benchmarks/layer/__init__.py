"""One decoder layer and its ops: time, memory held for the backward, GPU kernel profile, loss."""
