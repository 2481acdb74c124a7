"""The demo's world and models: pictures and questions rendered with PIL (`world`), questions that need no
picture (`talk`), the training of the shipped models into models/demo (`train`, `tower`), their scoring
(`evaluate`) and the example picture beside them. Not part of the installed package; the runtime never
imports it."""
