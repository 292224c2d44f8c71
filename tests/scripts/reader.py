"""A node that receives numbered messages in another process (tests freeze it with SIGSTOP): prints its address,
then, on the message ``end``, one JSON line with how many numbered messages came and whether in order."""
import json
import sys
import threading

from geomx.transport.van import ZmqVan

seen: list[int] = []
done = threading.Event()


def on_message(msg) -> None:
    if msg.op == "end":
        done.set()
    else:
        seen.append(msg["i"])


van = ZmqVan(node_id="reader", dc="a", on_message=on_message)
van.start()
print(van.address, flush=True)
if not done.wait(timeout=120):
    sys.exit("reader: no 'end' within 120 s")
print(json.dumps({"count": len(seen), "in_order": seen == sorted(seen), "first": seen[:1]}), flush=True)
van.stop()
