"""The control loop: the controller's tick over profiles and pods, and the status it writes."""
