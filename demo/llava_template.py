"""The LLaVA-1.5 conversation format as a Jinja chat template: the demo models' (models/demo/*/chat_template.jinja
hold this text), and the small random LLaVA fixtures' (tests.fixtures.vlm_zoo.llava).

Each message is its role's prefix, then its content: a list of parts (text, the image's placeholder), or a
string (as text models' templates are given it: pipespec.requests.tokenization), the same as one text part.
A system message has its own prefix, "SYSTEM: ".

The image goes right after the message's text, wherever its part stands. The causal language model then
reads the picture's tokens knowing the question, so each cell's token can mark itself as the one asked
about and the answer only has to find the marked token. With the picture first, the demo target named the
asked shape's colour 23% of the time after 2500 steps; with it after the question, 55% (issue 29's note,
experiments/results/demo_shapes).
"""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: {% elif message['role'] == 'system' %}SYSTEM: {% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>{% endif %}{% endfor %}"
    "{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
