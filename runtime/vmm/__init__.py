"""Virtual-memory reservations: address space per plan, pages committed per request."""
