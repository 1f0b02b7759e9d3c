"""The keys: who may use the port.  Named keys with their limits, hashed and private, applied
live (`key_store`; an expiry as people type it, and moments as they read them, `expiry`),
each key's usage kept across restarts (`usage`), teammates asking for a key (`enrolments`:
bounded, expiring, shared with `keys approve` through a file), the short code of such a
request, bound to its connection, and read as people type it (`enrolment_code`), and the
one rule of when the port takes them (`enrolment_window`).  Over the base only: the
admission reads a key's limits from here, the port checks keys against it."""
