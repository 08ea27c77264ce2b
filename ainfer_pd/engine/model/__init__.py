"""The model as walkable segments: layers, experts, routing, weights, sampling."""
