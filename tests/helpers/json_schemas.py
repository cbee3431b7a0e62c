"""Twenty JSON schemas of the shapes applications send (extraction, classification, forms), each with a
prompt that asks for it. Nested objects, arrays, enums, required fields and bounded numbers; strings and
arrays are bounded so that a complete answer fits the tests' token budget."""

from __future__ import annotations

S = {"type": "string", "maxLength": 24}
NAME = {"type": "string", "minLength": 1, "maxLength": 24}


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS: list[tuple[str, dict]] = [
    ("Give a person's name and age.", obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("Is the sky blue? Answer as JSON.", obj({"answer": {"type": "boolean"}})),
    ("Classify the sentiment of: I love this phone.",
     obj({"sentiment": {"enum": ["positive", "negative", "neutral"]},
          "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("List three colours.", obj({"colours": {"type": "array", "items": {"enum": ["red", "green", "blue", "yellow"]},
                                             "minItems": 3, "maxItems": 3}})),
    ("Describe a book.", obj({"title": NAME, "author": NAME, "year": {"type": "integer", "minimum": 1450,
                                                                      "maximum": 2030}})),
    ("Give a city and its country.", obj({"city": NAME, "country": {"type": "object",
                                                                    "properties": {"name": NAME, "code": {
                                                                        "type": "string", "pattern": "^[A-Z]{2}$"}},
                                                                    "required": ["name", "code"],
                                                                    "additionalProperties": False}})),
    ("Rate a movie from 1 to 5.", obj({"movie": NAME, "stars": {"type": "integer", "minimum": 1, "maximum": 5}})),
    ("Give a point in 3D.", obj({"x": {"type": "number", "minimum": -10, "maximum": 10},
                                 "y": {"type": "number", "minimum": -10, "maximum": 10},
                                 "z": {"type": "number", "minimum": -10, "maximum": 10}})),
    ("Make a to-do list of two items.",
     obj({"todos": {"type": "array", "minItems": 2, "maxItems": 2,
                    "items": obj({"task": NAME, "done": {"type": "boolean"}})}})),
    ("What is the weather like?", obj({"condition": {"enum": ["sunny", "rainy", "cloudy", "snowy"]},
                                       "temperature_c": {"type": "integer", "minimum": -40, "maximum": 50}})),
    ("Describe a user account.", obj({"username": {"type": "string", "pattern": "^[a-z]{3,12}$"},
                                      "admin": {"type": "boolean"},
                                      "roles": {"type": "array", "items": {"enum": ["reader", "writer"]},
                                                "maxItems": 2}}, ["username", "admin"])),
    ("Give an HTTP status.", obj({"code": {"enum": [200, 201, 404, 500]}, "reason": S})),
    ("Extract the date 3 March 2024.", obj({"day": {"type": "integer", "minimum": 1, "maximum": 31},
                                            "month": {"type": "integer", "minimum": 1, "maximum": 12},
                                            "year": {"type": "integer", "minimum": 1900, "maximum": 2100}})),
    ("Name a fruit and whether it is ripe.", obj({"fruit": NAME, "ripe": {"type": "boolean"}, "note": S},
                                                 ["fruit", "ripe"])),
    ("Give a product with a price.", obj({"product": NAME, "price": {"type": "number", "minimum": 0,
                                                                     "maximum": 10000},
                                          "currency": {"enum": ["USD", "EUR", "GBP"]}})),
    ("Give two numbers that add to ten.", obj({"pair": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 10},
                                                        "minItems": 2, "maxItems": 2}})),
    ("Describe a pet.", obj({"pet": obj({"kind": {"enum": ["cat", "dog", "fish"]}, "name": NAME,
                                         "age": {"type": "integer", "minimum": 0, "maximum": 30}})})),
    ("Give a yes or no with a reason.", obj({"decision": {"enum": ["yes", "no"]}, "reason": S})),
    ("Give an address.", obj({"street": NAME, "number": {"type": "integer", "minimum": 1, "maximum": 9999},
                              "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("Translate hello into French and Spanish.", obj({"translations": obj({"fr": S, "es": S})})),
]
