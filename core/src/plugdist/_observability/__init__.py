"""What watches every op: the profiler event and flight-recorder entry (``observe``), the
flight recorder and its dumps (``flight_recorder``)."""
