"""How a request is served, whatever carries it: the request and its decoders, the stream
plan, admission, stream leases and the idle cut, authentication, files, model views, Arrow
framing, errors in their wire form and metrics."""
