"""The demo's world and models: pictures and questions rendered with PIL (`world`), the training of the
shipped models into models/demo (`train`, `tower`) and the example picture beside them.
Not part of the installed package; the runtime never imports it."""
